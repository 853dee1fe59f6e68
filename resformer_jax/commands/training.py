"""Training as a command does it, without flags (commands/main.py parses them; tests and scripts call `run`):
the run directory made at the edge, the trainer, and a user error turned into one line and an exit code."""
from __future__ import annotations

import os
import sys

from resformer_jax.commands import common


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
        return Trainer(cfg, rundir, **dist).train()
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
