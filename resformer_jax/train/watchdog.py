"""A run that stalls says so: a thread in every training process that watches the loop's progress.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from etils import epath

from resformer_jax import storage
from resformer_jax.config import WatchdogConfig
from resformer_jax.errors import EXIT_STALLED


@dataclasses.dataclass(frozen=True)
class Phase:
    category: str  # the goodput ledger's category for time spent in it (train/goodput.py)
    budget: str  # the config.watchdog field bounding it; "step" is the loop's own budget


PHASES = {
    "start-up": Phase("startup", "startup_s"),
    "compile": Phase("compile", "compile_s"),
    "restore": Phase("restore", "checkpoint_s"),
    "data": Phase("data_wait", "step"),
    "step": Phase("steps", "step"),
    "evaluation": Phase("eval", "eval_s"),
    "checkpoint save": Phase("checkpoint", "checkpoint_s"),
    "finish": Phase("checkpoint", "checkpoint_s"),
}


PEER_GRACE_POLLS = 3  # polls a multi-process step's budget outlasts a data read's (each process polls on its own clock)


@dataclasses.dataclass(frozen=True)
class Budgets(WatchdogConfig):
    """The run's config.watchdog (its budgets and their defaults: config.WatchdogConfig) and how often to look."""

    poll_s: float = 1.0

    @classmethod
    def of(cls, section: WatchdogConfig) -> Budgets:
        return cls(**dataclasses.asdict(section))


class Watchdog:
    def __init__(self, budgets: Budgets, stack_file, process_index: int = 0, process_count: int = 1):
        self.budgets = budgets
        self.stack_file = stack_file  # RUN/watchdog/process_I.txt (local or object storage)
        self.process_index, self.process_count = process_index, process_count
        self.on_stall: list[Callable[[str, float], None]] = []  # (phase, seconds stalled), before the exit
        self.windows: list[float] = []  # seconds of each timed log window
        self._lock = threading.Lock()
        self._phase, self._step, self._since = "start-up", 0, time.monotonic()
        self._since_unix = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- what the loop tells it
    def enter(self, phase: str, step: int | None = None) -> None:
        assert phase in PHASES, phase
        with self._lock:
            self._phase, self._since, self._since_unix = phase, time.monotonic(), time.time()
            if step is not None:
                self._step = step

    def progress(self, step: int) -> None:
        """A step was dispatched: the clock of the current phase starts again."""
        with self._lock:
            self._step, self._since, self._since_unix = step, time.monotonic(), time.time()

    def window(self, seconds: float) -> None:
        """One log window's wall seconds (log_every steps): the loop's budget follows their median."""
        with self._lock:
            self.windows = (self.windows + [seconds])[-50:]

    def budget(self, phase: str) -> float:
        b = self.budgets
        field = PHASES[phase].budget
        if field != "step":
            return float(getattr(b, field))
        if not self.windows:
            base = float(b.compile_s)  # the first steps: a GPU autotunes its kernels on the first one
        else:
            base = max(float(b.min_step_s), b.step_factor * statistics.median(self.windows))
        if phase == "step" and self.process_count > 1:
            # A process inside a step waits on its peers' collectives: the peer stuck outside one (the cause) fires
            # first, as its exit would abort this one before its stacks were written.
            return base + PEER_GRACE_POLLS * b.poll_s
        return base

    # ---- the thread
    def start(self) -> Watchdog:
        if self.budgets.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="resformer-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def overdue(self, now: float | None = None) -> tuple[str, int, float, float, float] | None:
        """(phase, step, seconds in it, its budget, unix time it began) when the phase has outlived its budget."""
        now = time.monotonic() if now is None else now
        with self._lock:
            phase, step, since, since_unix = self._phase, self._step, self._since, self._since_unix
        age, budget = now - since, self.budget(phase)
        return (phase, step, age, budget, since_unix) if age > budget else None

    def _watch(self):
        while not self._stop.wait(self.budgets.poll_s):
            late = self.overdue()
            if late is not None:
                self.fire(*late)

    def fire(self, phase: str, step: int, age: float, budget: float, since_unix: float, exit=os._exit) -> None:
        line = (
            f"error: watchdog: process {self.process_index} made no progress for {age:.0f} s in phase '{phase}' "
            f"(step {step}; budget {budget:.0f} s, {_budget_flag(phase)}); every thread's stack is in "
            f"{self.stack_file}. Exiting with status {EXIT_STALLED}: rerun the same command to resume from the "
            "newest checkpoint"
        )
        if phase == "step" and self.process_count > 1:
            line += " (a step that never ends in a multi-host run is usually a collective waiting on another process)"
        header = (
            f"watchdog: process={self.process_index} phase={phase} step={step} stalled_s={age:.1f} "
            f"budget_s={budget:.1f} since_unix={since_unix:.3f}\n"
        )
        stacks = _all_stacks()
        try:
            epath.Path(self.stack_file).parent.mkdir(parents=True, exist_ok=True)
            storage.write_text_atomic(self.stack_file, header + stacks)
        except Exception as e:  # the stacks still go to stderr
            line += f" (could not write {self.stack_file}: {type(e).__name__}: {e})"
        print(header + stacks, file=sys.stderr, flush=True)
        for callback in self.on_stall:
            try:
                callback(phase, age)
            except Exception as e:  # the exit must happen whatever a callback does
                print(f"watchdog: a stall callback failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
        exit(EXIT_STALLED)


def _budget_flag(phase: str) -> str:
    field = PHASES[phase].budget
    if field == "step":
        return "--config.watchdog.step_factor / min_step_s raise it"
    return f"--config.watchdog.{field} raises it"


def _all_stacks() -> str:
    """Every thread's Python stack as faulthandler writes it (it needs a real file descriptor)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()
