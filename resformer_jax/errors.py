"""The one error type a user can fix: every command turns a UserError into one line on stderr and its exit code.

Each layer raises its own subclass (ConfigError, DataError, MeshError, CheckpointError, StorageError, ...),
whose message names the cause and the fix; commands catch UserError alone, so no list of classes exists to
keep in sync. An error that means the run itself went wrong rather than its input sets another exit code
(NonFiniteError: 3).
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user must change; the message says what. `exit_code` is the process's exit status."""

    exit_code: int = 2
