"""Run directories on local disk or object storage (gs://, s3://), through one path type.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from resformer_jax.storage.access import PROBE_TIMEOUT_S, StorageAccessError, probe_access
from resformer_jax.storage.files import (
    copy_file,
    files_under,
    move_tree,
    save_figure,
    staged_dir,
    write_json,
    write_text_atomic,
)
from resformer_jax.storage.linelog import SEGMENT_LINES, LineLog, has_lines, read_lines
from resformer_jax.storage.orbax_s3 import orbax_s3_paths
from resformer_jax.storage.paths import StorageError, check_supported, is_remote, run_path, scheme
from resformer_jax.storage.tensorboard import tensorboard_writers_for

__all__ = [
    "PROBE_TIMEOUT_S",
    "SEGMENT_LINES",
    "LineLog",
    "StorageAccessError",
    "StorageError",
    "check_supported",
    "copy_file",
    "files_under",
    "has_lines",
    "is_remote",
    "move_tree",
    "orbax_s3_paths",
    "probe_access",
    "read_lines",
    "run_path",
    "save_figure",
    "scheme",
    "staged_dir",
    "tensorboard_writers_for",
    "write_json",
    "write_text_atomic",
]
