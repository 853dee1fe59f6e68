"""What every command does first and last: XLA defaults before JAX starts, quiet library logs,
and a user's mistake turned into one line on stderr and an exit code, never a traceback.

  from resformer_jax import cli
  def main(argv):
      cli.start()
      with cli.exit_on_user_error():
          ...
"""
from __future__ import annotations

import contextlib
import sys


def start():
    """Sets the project's XLA defaults (before JAX starts its backend) and quiets absl's INFO logs
    (orbax and grain log every step at INFO)."""
    from resformer_jax.runtime import configure_xla
    configure_xla()
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)


def user_errors() -> tuple[type[BaseException], ...]:
    """Every exception class that means 'the user must change something' (each message says what)."""
    from resformer_jax.checkpoint import CheckpointError
    from resformer_jax.config import ConfigError
    from resformer_jax.data.records import DataError
    from resformer_jax.eval.zero_shot import TaskError
    from resformer_jax.kernels import KernelUnavailable
    from resformer_jax.parallel.mesh import MeshError
    from resformer_jax.train.loop import NonFiniteError
    from resformer_jax.train.setup import MemoryPrecheckError
    return (ConfigError, DataError, MeshError, CheckpointError, MemoryPrecheckError, NonFiniteError,
            KernelUnavailable, TaskError)


def exit_code(e: BaseException) -> int:
    """2 for a mistake in the input or config; 3 for a non-finite loss (the run itself diverged)."""
    from resformer_jax.train.loop import NonFiniteError
    return 3 if isinstance(e, NonFiniteError) else 2


def report_user_error(e: BaseException) -> int:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return exit_code(e)


@contextlib.contextmanager
def exit_on_user_error():
    """Runs the block; a user error prints its one-line message and exits with its code."""
    try:
        yield
    except user_errors() as e:
        sys.exit(report_user_error(e))
