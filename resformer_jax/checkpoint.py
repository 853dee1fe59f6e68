"""Orbax CheckpointManager wrapper: train state + data iterator state + config.

Saves are asynchronous and keep the newest `max_to_keep` (plus every
`keep_period`-th step). On start the newest checkpoint that restores is used;
a damaged one is reported with its step and path, moved aside to
`checkpoints_damaged/` (never deleted) and the previous one is tried.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import grain
import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class CheckpointError(Exception):
    """No checkpoint restores, or a resumed config conflicts; the message says what to do."""


class Checkpointer:
    def __init__(self, workdir: str, ckpt_cfg):
        absolute = (lambda p: p) if "://" in workdir else os.path.abspath  # gs:// paths stay as they are
        self.dir = absolute(os.path.join(workdir, "checkpoints"))
        self.damaged_dir = absolute(os.path.join(workdir, "checkpoints_damaged"))
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=ckpt_cfg.max_to_keep,
            keep_period=ckpt_cfg.keep_period or None,
            enable_async_checkpointing=bool(ckpt_cfg.async_save),
            create=True,
        )
        self.mngr = ocp.CheckpointManager(self.dir, options=opts,
                                          item_names=("state", "data", "config", "progress"))

    def all_steps(self):
        self.mngr.reload()
        return sorted(self.mngr.all_steps())

    def save(self, step: int, state, data_iter, config_dict: dict, progress: dict, force: bool = True):
        args = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(config_dict),
                "progress": ocp.args.JsonSave(progress)}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iter)
        self.mngr.save(step, args=ocp.args.Composite(**args), force=force)

    def wait(self):
        self.mngr.wait_until_finished()

    def reached_preemption(self, step: int) -> bool:
        return self.mngr.reached_preemption(step)

    def read_config(self, step: int) -> dict:
        r = self.mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return dict(r["config"])

    def restore(self, step: int, abstract_state):
        """(state, config, progress) of one step; raises if it does not restore."""
        r = self.mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), config=ocp.args.JsonRestore(),
            progress=ocp.args.JsonRestore()))
        return r["state"], dict(r["config"]), dict(r["progress"])

    def restore_latest(self, abstract_state, data_iter=None, warn=print):
        """(step, state, config, progress) of the newest checkpoint that restores, or None if there is none."""
        steps = self.all_steps()
        if not steps:
            return None
        failures = []
        for step in reversed(steps):
            try:
                state, config, progress = self.restore(step, abstract_state)
            except Exception as e:  # noqa: BLE001 - any failure means this checkpoint is unusable
                path = os.path.join(self.dir, str(step))
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                warn(f"WARNING: checkpoint at step {step} ({path}) does not restore ({reason}); "
                     "moving it to checkpoints_damaged/ and trying the previous one")
                failures.append((step, reason))
                self._quarantine(step)
                continue
            if data_iter is not None:
                try:
                    self.mngr.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(data_iter)))
                except Exception as e:  # noqa: BLE001
                    # Data order is a function of the step, so the position is recoverable.
                    warn(f"note: data iterator state of step {step} not restored ({type(e).__name__}); "
                         f"positioning the pipeline at step {step} from the step number")
                    data_iter.set_state({"next_index": int(step)})
            return step, state, config, progress
        raise CheckpointError(
            f"none of the checkpoints in {self.dir} restores ({failures}); they were moved to "
            f"{self.damaged_dir}. To start over, use a new --workdir; to retry, move them back.")

    def _quarantine(self, step: int):
        if jax.process_index() == 0:
            src = os.path.join(self.dir, str(step))
            if os.path.exists(src):
                os.makedirs(self.damaged_dir, exist_ok=True)
                dst = os.path.join(self.damaged_dir, str(step))
                if os.path.exists(dst):
                    shutil.rmtree(dst)
                shutil.move(src, dst)
        try:
            from jax.experimental import multihost_utils
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"quarantine_{step}")
        except Exception:  # noqa: BLE001
            pass
        self.mngr.reload()

    def close(self):
        self.mngr.wait_until_finished()
        self.mngr.close()


def config_diff(old: dict, new: dict, prefix: str = "") -> dict:
    """Flattened {field: (old, new)} for fields that differ."""
    out = {}
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        name = f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(config_diff(a, b, name + "."))
        elif json.dumps(a, default=list) != json.dumps(b, default=list):
            out[name] = (a, b)
    return out
