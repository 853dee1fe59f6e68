"""The one error type a user can fix: every command turns a UserError into one line on stderr and its exit code.

Each layer raises its own subclass (ConfigError, DataError, MeshError, CheckpointError, StorageError, ...),
whose message names the cause and the fix; commands catch UserError alone, so no list of classes exists to
keep in sync. An error that means the run itself went wrong rather than its input sets another exit code
(NonFiniteError: 3).
"""

from __future__ import annotations

# A process's exit statuses, here alone: schedulers and launchers tell a rerun from a fix by them.
EXIT_USER_ERROR = 2  # the input must change (a UserError; bad flags)
EXIT_DIVERGED = 3  # the loss or a gradient became non-finite (NonFiniteError)
EXIT_PEER_FAILED = 4  # another process of a multi-host run failed: rerun on every host to resume
EXIT_STALLED = 5  # the watchdog saw no progress within its budget: rerun to resume


class UserError(Exception):
    """Something the user must change; the message says what. `exit_code` is the process's exit status."""

    exit_code: int = EXIT_USER_ERROR


class ConfigError(UserError, ValueError):
    """An impossible or inconsistent config; the message names field and fix."""
