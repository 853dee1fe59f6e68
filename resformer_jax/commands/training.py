"""Training as a command does it, without flags (commands/main.py parses them; tests and scripts call `run`):
the run directory made at the edge, the trainer, and a user error turned into one line and an exit code."""

from __future__ import annotations

import os
import sys

from resformer_jax.commands import common
from resformer_jax.errors import EXIT_PEER_FAILED


def run(cfg, workdir: str, **dist) -> int:
    """Trains `cfg` in `workdir`; returns the process exit code. A user error prints one line, never a traceback;
    the libraries' own error reports (from their threads) go to a file that line names."""
    from resformer_jax.checkpoint import CheckpointWriteError
    from resformer_jax.errors import UserError
    from resformer_jax.rundir import RunDir
    from resformer_jax.train.loop import Trainer

    library_errors = common.divert_library_errors(workdir)
    try:
        rundir = RunDir(workdir)  # first: a missing gcsfs/s3fs names its extra before anything starts
        return Trainer(cfg, rundir, **dist, step_bound=step_bound).train()
    except (UserError, OSError) as e:  # OSError: a read-only or full disk, a missing folder
        code = common.report_user_error(e)
        if library_errors.path:
            print(f"(the libraries' own error reports are in {library_errors.path})", file=sys.stderr, flush=True)
        if isinstance(e, CheckpointWriteError):
            # Orbax's writer threads are still failing; leave without waiting on them (they would print
            # tracebacks at interpreter shutdown). What was saved before stays intact.
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(code)
        return code
    except Exception as e:
        if not _peer_failed(e):
            raise
        # Another process of a multi-host run died: this one's collective failed first (JAX's coordination service
        # would abort it later with a 100-line trace). One line, and leave without the shutdown barrier.
        import jax

        steps = RunDir(workdir).finished_steps() if jax.process_index() == 0 else []
        print(
            f"error: another process of this multi-host run failed (this is process {jax.process_index()}: "
            f"{str(e).splitlines()[0][:200]}); stopping. Rerun the same command on every host to resume from "
            + (f"step {steps[-1]}, " if steps else "")
            + "the newest checkpoint",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(EXIT_PEER_FAILED)


def step_bound(compiled, cfg, devices: int) -> str:
    """The start-up line's bound: the compiled step's roofline on this machine's accelerator (none on a CPU)."""
    import jax

    from resformer_jax import perf
    from resformer_jax.compilation.roofline import step_bound_line

    flops = perf.model_flops(cfg.model, cfg.data.seq_len).per_token * cfg.train.global_batch * cfg.data.seq_len
    return step_bound_line(compiled.as_text, jax.devices()[0].device_kind, flops / devices)


PEER_FAILURE_MARKS = (
    "Connection closed by peer",
    "heartbeat timeout",
    "stopped sending heartbeats",
    "coordination service",
    "NCCL error",
    "Connection reset by peer",
)


def _peer_failed(e: BaseException) -> bool:
    """Whether `e` is a collective failing because another process of a multi-host run died."""
    import jax

    if jax.process_count() <= 1 or type(e).__name__ not in ("JaxRuntimeError", "XlaRuntimeError"):
        return False
    return any(m in str(e) for m in PEER_FAILURE_MARKS)
