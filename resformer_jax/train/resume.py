"""A run directory's past, read before and while a run starts: whether it finished, was damaged or belongs to
another model; restoring its newest checkpoint that restores (or a new state); forking another run's checkpoint
(train.init_from). The trainer's start-up calls these; none of them trains."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from resformer_jax.checkpoint import (
    CheckpointError,
    checkpoint_history,
    config_diff,
    no_fresh_start,
    params_layout,
)
from resformer_jax.config import RUNTIME_MODEL_FIELDS, get_dotted, parse_init_from, with_defaults
from resformer_jax.errors import UserError, one_line
from resformer_jax.resolve import fork_point
from resformer_jax.rundir import RunDir
from resformer_jax.storage import is_remote
from resformer_jax.train.setup import TrainSetup


class Resume:
    """One run directory's resume and fork. `say`: progress lines; `warn`: a damaged checkpoint set aside;
    `enter`: the trainer's phase (the watchdog's budget and the goodput ledger's category)."""

    def __init__(self, run: RunDir, say: Callable[[str], Any], warn: Callable[[str], Any], enter: Callable[[str], Any]):
        self.run, self.say, self.warn, self.enter = run, say, warn, enter

    def check_run_dir(self, cfg) -> int | None:
        """The run directory, from the file system alone, before anything takes seconds: a file or an unwritable
        folder, checkpoints that were deleted, a run already finished. Returns the finished run's step (nothing to
        do), else None."""
        path = self.run.path
        if not is_remote(self.run.workdir):
            if path.exists() and not path.is_dir():
                raise UserError(f"--workdir {self.run.workdir} is a file, not a directory; give a folder for the run")
            existing = next((p for p in [path, *path.parents] if p.exists()), None)
            if existing is not None and not os.access(os.fspath(existing), os.W_OK | os.X_OK):
                raise UserError(
                    f"--workdir {self.run.workdir}: {existing} is not writable by this user; fix its permissions or "
                    "give another --workdir"
                )
        steps = self.run.finished_steps() if self.run.checkpoints.is_dir() else []
        if not steps and not cfg.checkpoint.allow_fresh_start:
            history = checkpoint_history(self.run.checkpoints_damaged, self.run.checkpoints_written_marker)
            if history:
                raise no_fresh_start(self.run.workdir, history)
        end = min(cfg.train.stop_at or cfg.train.steps, cfg.train.steps)
        if steps and steps[-1] >= end:
            return steps[-1]
        return None

    def restores(self, setup: TrainSetup, step: int) -> bool:
        """Whether the checkpoint at `step` restores with every array's fingerprint intact (a damaged one is left
        to the normal path, which sets it aside and resumes from the one before)."""
        with self.run.checkpointer(read_only=True) as ck:
            try:
                ck.restore(step, setup.abstract_state)
                return True
            except Exception:
                return False

    def check_workdir_model(self, cfg, corpus):
        """The run directory's model against this config, every differing field in one line, before the probe and
        the compile (a resumed run cannot change the model)."""
        if not self.run.checkpoints.is_dir():
            return
        with self.run.checkpointer(read_only=True) as ck:
            newest = ck.newest_config()
        if newest is not None:
            self.check_resumed_config(newest[1], cfg.to_dict(), corpus, quiet=True)

    def check_resumed_config(self, old: dict, new: dict, corpus, quiet: bool = False):
        """`old` (a checkpoint's record) against `new` (this run's record, or its config as asked), both as the run
        records itself: a field resolved on each machine and not recorded (model.matmuls, model.norm_impl) is
        compared as asked, not as this machine resolved it."""
        diff = config_diff(with_defaults(old), with_defaults(new))  # a field added since the run started is no change
        model = {f: ab for f, ab in diff.items() if f.startswith("model.") and f not in RUNTIME_MODEL_FIELDS}
        if model:
            raise CheckpointError(
                f"the run in {self.run.workdir} was started with another model ("
                + ", ".join(f"config.{f} is {b!r}, the run's {a!r}" for f, (a, b) in model.items())
                + "); a resumed run cannot change the model. Use "
                + " ".join(f"--config.{f}={a!r}" for f, (a, _) in model.items())
                + " or a new --workdir"
            )
        if corpus is not None:
            corpus.check_tokenizer(get_dotted(with_defaults(old), "data.tokenizer_hash", {}))
        for field, (a, b) in ({} if quiet else diff).items():
            if field != "data.tokenizer_hash":
                self.say(f"note: config.{field} changed on resume: {a!r} -> {b!r}")

    def check_params_fit(self, ckpt, setup: TrainSetup, cfg, step: int, old: dict):
        """The checkpoint's parameter tree against the one this config builds: a difference is a changed
        config, not damage, so nothing is moved (derived from the trees, not a list of fields)."""
        saved = ckpt.saved_params_layout(step)
        if saved is None:
            return
        want = params_layout(setup.abstract_state.params)
        if saved == want:
            return
        only_saved, only_new = sorted(set(saved) - set(want)), sorted(set(want) - set(saved))
        reshaped = sorted(p for p in set(saved) & set(want) if saved[p] != want[p])
        parts = (
            ([f"only in the checkpoint: {only_saved[:3]}"] if only_saved else [])
            + ([f"only in this config: {only_new[:3]}"] if only_new else [])
            + [f"{p}: {saved[p]} saved, {want[p]} now" for p in reshaped[:3]]
        )
        fields = list(config_diff(old.get("model", {}), cfg.model.to_dict()))
        raise CheckpointError(
            f"the checkpoint at step {step} in {self.run.workdir} holds other parameters than this config builds "
            f"({'; '.join(parts)}); "
            + (f"changed model fields: {', '.join('config.model.' + f for f in fields)}; " if fields else "")
            + "use the run's original config or a new --workdir (nothing was moved)"
        )

    def restore(self, cfg, setup: TrainSetup, ckpt, data, corpus) -> tuple[Any, int, dict]:
        """(state, its step, the restored progress): the newest checkpoint that restores, or a fresh state."""
        # The run's parameter tree before touching its state: a shape change is the user's mistake, not a damaged
        # checkpoint, and must not set good checkpoints aside (the config's fields were compared at start).
        self.enter("restore")
        newest = ckpt.newest_config()
        if newest is not None:
            self.check_params_fit(ckpt, setup, cfg, *newest)
        restored = ckpt.restore_latest(setup.abstract_state, data, warn=self.warn)
        if restored is None and cfg.train.init_from and not ckpt.history():
            return self.fork(cfg, setup, data, corpus)
        if restored is None:
            history = ckpt.history()
            if history and not cfg.checkpoint.allow_fresh_start:
                raise no_fresh_start(self.run.workdir, history)
            self.say(f"starting a new run in {self.run.workdir}")
            self.enter("start-up")  # nothing restored: a new state is start-up work
            return setup.init_state(), 0, {}
        step, state, old_cfg, progress = restored
        self.check_resumed_config(old_cfg, setup.run.record(), corpus)
        self.say(f"resumed from step {step} ({ckpt.dir}/{step})")
        return state, step, progress

    def check_fork(self, cfg, corpus):
        """train.init_from before anything costly or written: the run, the step and the model."""
        if not cfg.train.init_from or (self.run.checkpoints.is_dir() and any(self.run.checkpoints.iterdir())):
            return
        run, step = parse_init_from(fork_point(cfg, self.run, log=lambda _: None))
        source = RunDir(run)
        if not source.checkpoints.is_dir():
            raise CheckpointError(f"train.init_from: run directory {run} has no checkpoints; check the path")
        with source.checkpointer(read_only=True) as src:
            steps = src.all_steps()
            if step not in steps:
                raise CheckpointError(f"train.init_from: no checkpoint at step {step} in {src.dir}; available: {steps}")
            self.check_resumed_config(src.read_config(step), cfg.to_dict(), corpus, quiet=True)

    def fork(self, cfg, setup: TrainSetup, data, corpus) -> tuple[Any, int, dict]:
        """A new run from another run's checkpoint (train.init_from=RUN:STEP): its parameters, optimizer state and
        data position at STEP; the WSD decay starts there (set before the build, `forked`)."""
        run, step = parse_init_from(cfg.train.init_from)
        assert step is not None  # config.validate requires RUN:STEP
        with RunDir(run).checkpointer(read_only=True) as src:
            try:
                state, _, progress = src.restore(step, setup.abstract_state)
            except Exception as e:  # a damaged source is the user's to choose around: nothing here is moved
                raise CheckpointError(
                    f"train.init_from: the checkpoint at step {step} in {src.dir} does not restore "
                    f"({one_line(e)}); fork from another step (available: {src.all_steps()})"
                ) from None
            src.restore_data(step, data, self.warn)
        self.say(f"forked from {run} at step {step}: its parameters, optimizer state and data position")
        return state, step, progress
