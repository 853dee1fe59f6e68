"""Orbax CheckpointManager wrapper: train state + data iterator state + config.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import errno
import json
import logging
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from resformer_jax import storage
from resformer_jax.errors import UserError, one_line

log = logging.getLogger(__name__)


class CheckpointError(UserError):
    """No checkpoint restores, or a resumed config conflicts; the message says what to do."""


class CheckpointWriteError(CheckpointError):
    """Storage refused a checkpoint (full, quota, read-only, permissions); the earlier ones are intact."""


class DamagedCheckpoint(Exception):
    """A checkpoint's bytes do not match what was saved (raised inside restore, handled by fallback)."""


STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def storage_error(e: BaseException) -> OSError | None:
    """The OSError (disk full, quota, read-only, permission) behind an exception, if any. TensorStore reports
    these as ValueErrors whose text carries the OS message, so that is recognised too."""
    seen = set()
    at: BaseException | None = e
    while at is not None and id(at) not in seen:
        e = at
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        for code in STORAGE_ERRNOS:
            if os.strerror(code) in str(e):
                return OSError(code, os.strerror(code))
        at = e.__cause__ or e.__context__
    return None


def _bits_u32(x):
    """The array's bits as uint32 words (one per element; 8-byte types fold their halves)."""
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    as_uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[size]
    bits = jax.lax.bitcast_convert_type(x, as_uint)
    if size == 8:
        bits = (bits >> 32) ^ (bits & 0xFFFFFFFF)
    return bits.astype(jnp.uint32)


def _fingerprint(x):
    """[sum of the words, sum of word * (position mod 65521 + 1)], both wrapping: any changed byte or
    moved block changes one of them."""
    w = _bits_u32(x).reshape(-1)
    pos = (jnp.arange(w.shape[0], dtype=jnp.uint32) % jnp.uint32(65521)) + jnp.uint32(1)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * pos, dtype=jnp.uint32)])


def _path(p) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in p)


# One jitted function for every save and restore (a new lambda per call would compile again each time).
_fingerprint_tree = jax.jit(lambda tree: jax.tree.map(_fingerprint, tree))


def fingerprints(state) -> dict[str, list[int]]:
    """{array path: [two uint32 sums]} of every array in the state, computed where the arrays live."""
    fps = _fingerprint_tree(state)
    return {
        _path(p): [int(v) for v in np.asarray(jax.device_get(x))] for p, x in jax.tree_util.tree_leaves_with_path(fps)
    }


def checkpoint_history(damaged_dir, history_marker) -> list[str]:
    """What shows a run directory once held checkpoints: damaged ones set aside, the marker of the last save (read
    from the file system alone, no checkpoint manager)."""
    out = []
    damaged = sorted(p.name for p in damaged_dir.iterdir()) if damaged_dir.is_dir() else []
    if damaged:
        out.append(f"{damaged_dir} holds {damaged}")
    if history_marker.is_file():
        out.append(f"checkpoints were written here up to step {history_marker.read_text().strip()}")
    return out


def no_fresh_start(workdir: str, history: list[str]) -> CheckpointError:
    """The refusal to start again from step 0 over a run directory that once held checkpoints."""
    return CheckpointError(
        f"{workdir} once held checkpoints ({'; '.join(history)}) but none is there to resume from; refusing to "
        "start again from step 0. Move the checkpoints back to retry, or pass "
        "--config.checkpoint.allow_fresh_start=True to start over (or use a new --workdir)"
    )


def params_layout(tree) -> dict[str, tuple]:
    """{parameter path: shape} of a parameter tree (arrays, ShapeDtypeStructs or orbax metadata)."""
    return {_path(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def finished_checkpoint_steps(directory) -> list[int]:
    """The steps of the finalized checkpoints in an Orbax checkpoints folder, oldest first (Orbax's own query; no
    manager is opened, nothing is created)."""
    return sorted(ocp.path.step.checkpoint_steps(directory))


class NotRestored:
    """What an item's restore raised on this process, returned instead of raised: every process then reaches
    Orbax's barrier after a restore, and they decide together (`_agreed`) whether the step restored. A file only
    one process reads (its data position) or a read that fails on one host alone fails on that process alone;
    raised, it left the others waiting inside Orbax's barrier while it went on, and the run lost sync and hung."""

    def __init__(self, error: Exception):
        self.error = error


def _returning_failures(handler):
    """`handler` with a restore that returns a NotRestored instead of raising. Its type is kept (Orbax matches a
    handler to its arguments by type and writes the type's name into a checkpoint's metadata), so checkpoints read
    and write as before."""
    restore = handler.restore

    def restore_returning_failures(*args, **kwargs):
        try:
            return restore(*args, **kwargs)
        except Exception as e:
            return NotRestored(e)

    handler.restore = restore_returning_failures
    return handler


def _agreed(step: int, items: dict) -> None:
    """Raises on every process if any item failed on any process (this process's own error where it failed);
    returns on every process otherwise."""
    failed = [x.error for x in items.values() if isinstance(x, NotRestored)]
    where = [0] if failed else []
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(1 if failed else 0, np.int32))
        where = [i for i, f in enumerate(np.asarray(flags).reshape(-1)) if f]
    if failed:
        raise failed[0]
    if where:
        raise DamagedCheckpoint(f"process {where[0]} of this multi-host run could not read its part of step {step}")


class Checkpointer:
    def __init__(self, run, ckpt_cfg, create: bool = True):
        """`run`: the RunDir (rundir.py) whose checkpoints these are; RunDir.checkpointer() makes one."""
        self.workdir = run.workdir
        root = run.path
        self.dir = run.checkpoints
        self.damaged_dir = run.checkpoints_damaged
        self.history_marker = run.checkpoints_written_marker
        remote = storage.is_remote(root)
        if storage.scheme(root) == "s3":
            storage.orbax_s3_paths()
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=ckpt_cfg.max_to_keep,
            keep_period=ckpt_cfg.keep_period or None,
            enable_async_checkpointing=bool(ckpt_cfg.async_save),
            create=create,
            # No atomic rename on object storage: a commit file marks a finished checkpoint (what Orbax
            # does by itself for gs://; s3:// needs it said).
            temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath if remote else None,
        )
        self.mngr = ocp.CheckpointManager(
            self.dir,
            options=opts,
            item_names=("state", "data", "config", "progress", "fingerprints"),
            # Every item's handler is registered, the data iterator's (grain) included: Orbax then knows each item
            # when it reads a checkpoint's metadata or restores only some items (it warned that "data could not
            # be restored" otherwise, although the data position is restored, through its own restore call).
            # Each restore returns its failure (NotRestored) rather than raising it: see `_agreed`.
            item_handlers={
                "state": _returning_failures(ocp.StandardCheckpointHandler()),
                "data": _returning_failures(grain.checkpoint.CheckpointHandler()),
                "config": _returning_failures(ocp.JsonCheckpointHandler()),
                "progress": _returning_failures(ocp.JsonCheckpointHandler()),
                "fingerprints": _returning_failures(ocp.JsonCheckpointHandler()),
            },
        )

    def saved_params_layout(self, step: int) -> dict[str, tuple] | None:
        """{path: shape} of the parameters a checkpoint holds, from its metadata (None if unreadable)."""
        try:
            md = self.mngr.item_metadata(step)["state"]
            tree = getattr(md, "tree", md)
            return params_layout(tree["params"])
        except Exception:
            return None

    def history(self) -> list[str]:
        """What shows this workdir once held checkpoints (the marker, damaged ones set aside)."""
        return checkpoint_history(self.damaged_dir, self.history_marker)

    def all_steps(self):
        # An in-flight asynchronous save must finish first: reloading under it forgets that step, and
        # the manager would then keep max_to_keep + 1 checkpoints.
        self.wait()
        self.mngr.reload()
        return sorted(self.mngr.all_steps())

    def save(self, step: int, state, data_iter, config_dict: dict, progress: dict, force: bool = True):
        args = {
            "state": ocp.args.StandardSave(state),
            "config": ocp.args.JsonSave(config_dict),
            "progress": ocp.args.JsonSave(progress),
            "fingerprints": ocp.args.JsonSave(fingerprints(state)),
        }
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iter)
        try:
            self.mngr.save(step, args=ocp.args.Composite(**args), force=force)
        except Exception as e:
            raise self._write_failed(step, e) from None
        if jax.process_index() == 0:
            storage.write_text_atomic(self.history_marker, str(step))

    def wait(self):
        try:
            self.mngr.wait_until_finished()
        except Exception as e:
            raise self._write_failed(None, e) from None

    def _write_failed(self, step, e: BaseException) -> Exception:
        err = storage_error(e)
        if err is None:
            return e if isinstance(e, Exception) else RuntimeError(str(e))
        steps = [s for s in sorted(self.mngr.all_steps()) if step is None or s < step]
        kept = f"the checkpoint at step {steps[-1]} is intact" if steps else "no earlier checkpoint exists"
        return CheckpointWriteError(
            f"could not write the checkpoint{'' if step is None else f' at step {step}'} to {self.dir}: "
            f"{err.strerror or err} ({getattr(err, 'filename', '') or 'while writing'}); {kept}. Free space, "
            "fix the permissions, or use another --workdir, then rerun the same command"
        )

    def reached_preemption(self, step: int) -> bool:
        return self.mngr.reached_preemption(step)

    def newest_config(self) -> tuple[int, dict] | None:
        """(step, config) of the newest checkpoint whose config reads, or None (an unreadable one is skipped:
        restoring it reports the damage)."""
        for step in reversed(self.all_steps()):
            try:
                return step, self.read_config(step)
            except Exception:
                continue
        return None

    def read_config(self, step: int) -> dict:
        r = self.mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        _agreed(step, {"config": r["config"]})
        return dict(r["config"])

    def restore(self, step: int, abstract_state):
        """(state, config, progress) of one step; raises if it does not restore or if an array's bits differ
        from the fingerprint saved with it."""
        r = self.mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                config=ocp.args.JsonRestore(),
                progress=ocp.args.JsonRestore(),
            ),
        )
        _agreed(step, {k: r[k] for k in ("state", "config", "progress")})
        self._check_fingerprints(step, r["state"])
        return r["state"], dict(r["config"]), dict(r["progress"])

    def restore_params(self, step: int):
        """The parameters of one step, for a reader (on the first device): the whole state restored as it was
        saved, its tree read from the checkpoint's metadata (a reader builds no optimizer for a template), and
        checked against its fingerprints as `restore` checks it; the parameters returned."""
        on = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        saved = self.mngr.item_metadata(step)["state"]
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on),
            getattr(saved, "tree", saved),
            is_leaf=lambda a: hasattr(a, "shape") and hasattr(a, "dtype"),
        )
        state = self.mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        _agreed(step, {"state": state})
        self._check_fingerprints(step, state)
        return state["params"]

    def _check_fingerprints(self, step: int, restored) -> None:
        """DamagedCheckpoint if a restored array's bits differ from the fingerprint saved with it, or the arrays
        are not those saved."""
        try:
            saved = self.mngr.restore(step, args=ocp.args.Composite(fingerprints=ocp.args.JsonRestore()))
            _agreed(step, {"fingerprints": saved["fingerprints"]})
            saved = dict(saved["fingerprints"])
        except Exception as e:
            if not (self.dir / str(step) / "fingerprints").exists():
                return  # checkpoints written before fingerprints existed
            raise DamagedCheckpoint(f"the fingerprints saved with it do not read ({one_line(e)})") from None
        now = fingerprints(restored)
        bad = [p for p in saved if now.get(p) != saved[p]]
        if bad or set(now) != set(saved):
            raise DamagedCheckpoint(
                f"array {(bad or sorted(set(now) ^ set(saved)))[0]} does not match the "
                f"fingerprint saved with it ({len(bad)} arrays differ)"
            )

    def restore_data(self, step: int, data_iter, warn=print) -> None:
        """The data iterator at the position saved with `step`."""
        try:
            r = self.mngr.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(data_iter)))
            if isinstance(r["data"], NotRestored):  # this process's own position: nothing to agree on
                raise r["data"].error
        except Exception as e:
            # Data order is a function of the step, so the position is recoverable.
            warn(
                f"note: data iterator state of step {step} not restored ({type(e).__name__}); "
                f"positioning the pipeline at step {step} from the step number"
            )
            data_iter.set_state({"next_index": int(step)})

    def restore_latest(self, abstract_state, data_iter=None, warn=print):
        """(step, state, config, progress) of the newest checkpoint that restores, or None if there is none."""
        steps = self.all_steps()
        if not steps:
            return None
        failures = []
        for step in reversed(steps):
            try:
                state, config, progress = self.restore(step, abstract_state)
            except Exception as e:
                path = self.dir / str(step)
                reason = one_line(e)
                warn(
                    f"WARNING: checkpoint at step {step} ({path}) does not restore ({reason}); "
                    "moving it to checkpoints_damaged/ and trying the previous one"
                )
                failures.append((step, reason))
                self._quarantine(step)
                continue
            if data_iter is not None:
                self.restore_data(step, data_iter, warn)
            return step, state, config, progress
        raise CheckpointError(
            f"none of the checkpoints in {self.dir} restores ({failures}); they were moved to "
            f"{self.damaged_dir}. To retry, move them back; to start over, use a new --workdir or pass "
            "--config.checkpoint.allow_fresh_start=True"
        )

    def _quarantine(self, step: int):
        if jax.process_index() == 0:
            src = self.dir / str(step)
            if src.exists():
                self.damaged_dir.mkdir(parents=True, exist_ok=True)
                storage.move_tree(src, self.damaged_dir / str(step))
        try:
            from jax.experimental import multihost_utils

            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"quarantine_{step}")
        except Exception:
            pass
        self.mngr.reload()

    def close(self):
        self.mngr.wait_until_finished()
        self.mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):  # `with run.checkpointer(read_only=True) as ck:` closes it after the block
        self.close()


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
