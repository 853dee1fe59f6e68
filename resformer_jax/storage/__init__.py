"""Run directories on local disk or object storage (gs://, s3://), through one path type.

Every path a command writes to or reads from goes through `run_path` (an
`etils.epath.Path`, the abstraction Orbax and grain use): local paths are `pathlib` paths, gs:// and
s3:// paths go through fsspec (gcsfs, s3fs). What object storage lacks is handled here once:

- no append: `LineLog` keeps metrics.jsonl's lines in segment objects (`metrics.jsonl.parts/`), each
  rewritten whole at every flush and closed after `SEGMENT_LINES` lines or when the process ends, so a
  preempted run loses at most the lines since its last flush (as a local file does);
- no rename: `write_text_atomic` relies on an object appearing whole when its upload ends;
- Orbax 0.12 builds TensorStore specs for gs:// and local paths only; `orbax_s3_paths` gives it s3://
  (TensorStore's own s3 driver) by building the gs:// spec and swapping the driver.

TensorBoard event files go through epath too (`tensorboard_writers_for`).

Emulators: gcsfs follows STORAGE_EMULATOR_HOST, TensorStore follows TENSORSTORE_GCS_HTTP_URL (and
GOOGLE_AUTH_TOKEN_FOR_TESTING); s3fs and TensorStore follow AWS_ENDPOINT_URL. tests/test_cloud.py runs real runs
against gcp-storage-emulator and moto's server.

One module per job: paths.py (schemes, run_path), access.py (credential and network probes), files.py (atomic
writes, figures, staged folders), linelog.py (metrics.jsonl on object storage), orbax_s3.py, tensorboard.py.
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
