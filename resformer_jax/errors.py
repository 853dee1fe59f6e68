"""The one error type a user can fix: every command turns a UserError into one line on stderr and its exit code.

Its notes (the reasons, what was measured): docs/modules.md.
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


def one_line(e: BaseException, limit: int | None = None) -> str:
    """An exception in one line, as messages quote it: its type and its message's first line (cut at `limit`)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"
