"""Ctrl-C or SIGTERM during a run's start-up (the compile, the state, the first validation) stops it within a
second: Python runs a signal handler only between bytecodes, so a handler alone would wait out a compile of
minutes. The signal's byte reaches a thread through `signal.set_wakeup_fd`, which acts while the main thread is
inside XLA. Once the loop runs, the trainer's own handler saves and exits as before."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable


class StartupInterrupt:
    """While open, a SIGINT/SIGTERM prints `say_stopped()`'s line, removes the run directory if this start made
    it and it holds no checkpoint (`made_here()`), and exits 0 at once. Main thread only (set_wakeup_fd)."""

    def __init__(self, stopped_line: Callable[[str], str], leftover: Callable[[], str | None]):
        self._line, self._leftover = stopped_line, leftover
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._open = True
        self._thread = threading.Thread(target=self._watch, name="startup-interrupt", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            try:
                data = self._read.recv(1)
            except OSError:
                return
            if not data or not self._open:
                return
            if data[0] in (signal.SIGINT, signal.SIGTERM):
                name = signal.Signals(data[0]).name
                leftover = self._leftover()
                if leftover is not None:
                    shutil.rmtree(leftover, ignore_errors=True)
                print(self._line(name), file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(0)

    def close(self) -> None:
        """Start-up is over: signals go to the trainer's handler alone."""
        if not self._open:
            return
        self._open = False
        signal.set_wakeup_fd(self._old_fd)
        with contextlib.suppress(OSError):
            self._read.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=1)
        self._read.close()
        self._write.close()
