"""The one owner of a run directory: made once from `--workdir` at a command's edge, it names every file and
folder a run holds, and gives the read-only checkpointer and the finished-steps query. Nothing else spells
these names.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import json

from etils import epath
from tokenizers import Tokenizer

from resformer_jax import storage
from resformer_jax.checkpoint import Checkpointer, finished_checkpoint_steps

SWEEP_MANIFEST = "sweep.json"  # a sweep directory's manifest (commands/sweep.py writes it; compare reads it)


class RunDir:
    """A run directory (it need not exist yet). `str(run)` is the path as the user gave it."""

    def __init__(self, workdir):
        if isinstance(workdir, RunDir):
            workdir = workdir.workdir
        self.workdir = str(workdir)
        self.path: epath.Path = storage.run_path(self.workdir)  # raises StorageError naming a missing extra
        storage.probe_access(self.workdir)  # credentials and network, in seconds, before any work

    def __str__(self) -> str:
        return self.workdir

    def __repr__(self) -> str:
        return f"RunDir({self.workdir!r})"

    # ---- what a run holds
    @property
    def checkpoints(self) -> epath.Path:
        return self.path / "checkpoints"

    @property
    def checkpoints_damaged(self) -> epath.Path:
        return self.path / "checkpoints_damaged"

    @property
    def checkpoints_written_marker(self) -> epath.Path:
        return self.path / "checkpoints_written"

    @property
    def config_json(self) -> epath.Path:
        return self.path / "config.json"

    @property
    def metrics_jsonl(self) -> epath.Path:
        return self.path / "metrics.jsonl"

    @property
    def tensorboard(self) -> epath.Path:
        return self.path / "tb"

    @property
    def tokenizer_json(self) -> epath.Path:
        return self.path / "tokenizer.json"

    @property
    def goodput_json(self) -> epath.Path:
        return self.path / "goodput.json"

    def watchdog_stacks(self, process_index: int) -> epath.Path:
        return self.path / "watchdog" / f"process_{process_index}.txt"

    @property
    def eval_dir(self) -> epath.Path:
        return self.path / "eval"

    @property
    def analysis_dir(self) -> epath.Path:
        return self.path / "analysis"

    @property
    def library_errors_log(self) -> epath.Path:
        return self.path / "library_errors.log"

    # ---- reading it
    def is_run(self) -> bool:
        """Whether this folder holds a run: checkpoints, logged metrics, or a training config.json (a Hugging Face
        export's config.json is not one)."""
        if (
            self.checkpoints.is_dir()
            or self.checkpoints_written_marker.is_file()
            or storage.has_lines(self.metrics_jsonl)
        ):
            return True
        try:
            cfg = self.read_config()
        except (OSError, ValueError):
            return False
        return isinstance(cfg, dict) and "train" in cfg and "model" in cfg

    def has_metrics(self) -> bool:
        """Whether the run has logged at least one line to metrics.jsonl (an empty file is a run not yet logging)."""
        return storage.has_lines(self.metrics_jsonl) and any(
            ln.strip() for ln in storage.read_lines(self.metrics_jsonl)
        )

    def read_config(self) -> dict:
        """config.json as written at the run's start (json.JSONDecodeError / OSError as they come)."""
        return json.loads(self.config_json.read_text())

    def write_config(self, text: str) -> None:
        storage.write_text_atomic(self.config_json, text)

    def tokenizer(self):
        """The run's tokenizer (tokenizer.json), or None when the run trained on synthetic data."""
        if not self.tokenizer_json.is_file():
            return None

        return Tokenizer.from_str(self.tokenizer_json.read_text())

    def checkpointer(self, ckpt_cfg=None, *, read_only: bool = False):
        """The run's Orbax checkpointer: the training one (from config.checkpoint), or a read-only one that keeps
        every step and creates nothing (for evaluation, export, analysis and compare)."""
        if read_only:
            import ml_collections

            ckpt_cfg = ml_collections.ConfigDict({"max_to_keep": 1000, "keep_period": 0, "async_save": False})
        return Checkpointer(self, ckpt_cfg, create=not read_only)

    def finished_steps(self) -> list[int]:
        """Steps of the checkpoints that finished writing, oldest first, without opening Orbax's manager (a
        folder still being written is not finished: Orbax renames or commits it last)."""
        return finished_checkpoint_steps(self.checkpoints)
