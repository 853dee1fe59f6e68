"""Where a run's hours went: the goodput ledger, kept in RUN/goodput.json and added up across restarts.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import json
import threading
import time

from resformer_jax import storage

CATEGORIES = ("startup", "compile", "restore", "data_wait", "steps", "eval", "checkpoint", "stalled")


def process_start_unix() -> float:
    """When this Python interpreter started (its imports count as start-up): the first import of the package, or
    before the one restart runtime.py may make (same PID), that first interpreter's. Never the process's creation
    time, which is an exec'ing shell's (`... && exec python`, SLURM scripts) and would bill its work here."""
    import os

    import resformer_jax
    from resformer_jax.runtime import STARTED_ENV

    pid, _, started = os.environ.get(STARTED_ENV, "").partition(":")
    if pid == str(os.getpid()):
        try:
            return float(started)
        except ValueError:
            pass
    return resformer_jax.IMPORTED_UNIX


def read(path) -> list[dict]:
    """The invocations recorded in RUN/goodput.json ([] when there is none; a damaged file is not trusted)."""
    try:
        data = json.loads(path.read_text())
        return list(data["invocations"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def totals(invocations: list[dict]) -> dict:
    """Seconds per category over every invocation, wall, recomputed, productive and goodput."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    wall = recomputed = 0.0
    for inv in invocations:
        for k, v in inv.get("seconds", {}).items():
            out[k] = out.get(k, 0.0) + float(v)
        wall += float(inv.get("wall_s", 0.0))
        recomputed += float(inv.get("recomputed_s", 0.0))
    productive = max(out["steps"] - recomputed, 0.0)
    return {
        "seconds": out,
        "wall_s": wall,
        "recomputed_s": recomputed,
        "productive_s": productive,
        "goodput": productive / wall if wall > 0 else 0.0,
        "invocations": len(invocations),
        "unknown": sum(1 for inv in invocations if inv.get("end") == "unknown"),
    }


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def describe(t: dict) -> str:
    """One line: goodput, productive over wall, and every category with time in it."""
    parts = [f"{k} {_s(v)}" for k, v in t["seconds"].items() if v >= 0.05 and k != "steps"]
    if t["recomputed_s"] >= 0.05:
        parts.append(f"recomputed steps {_s(t['recomputed_s'])}")
    return (
        f"goodput {100 * t['goodput']:.1f}%: productive step time {_s(t['productive_s'])} of {_s(t['wall_s'])} "
        f"over {t['invocations']} invocation(s)" + (f"; {', '.join(parts)}" if parts else "")
    )


class Ledger:
    """This invocation's clock, and the records of the earlier ones (written by process 0 only)."""

    def __init__(self, path, started_unix: float | None = None):
        self.path = path  # RUN/goodput.json
        self.enabled = False  # keeps time only, until `start_writing` (a refused start writes nothing)
        self.earlier: list[dict] = []
        self.started = process_start_unix() if started_unix is None else started_unix
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.category = "startup"
        self._t = self.started
        self._lock = threading.Lock()
        self.steps: list[int | None] = [None, None]  # [first step of this invocation, last step it finished]
        self.recomputed_steps, self.recomputed_s = 0, 0.0
        self._written = 0.0  # time.monotonic() of the last write

    def start_writing(self, enabled: bool = True) -> None:
        """The run has started: read the earlier invocations (process 0 writes; the others keep time only)."""
        self.enabled = enabled
        self.earlier = read(self.path) if enabled else []
        for inv in self.earlier:  # one still open when this one starts ended without a word
            if inv.get("end") == "open":
                inv["end"] = "unknown"

    def switch(self, category: str) -> str:
        """Charges the time since the last switch to the current category; returns it."""
        assert category in CATEGORIES, category
        with self._lock:
            now = time.time()
            self.seconds[self.category] += max(now - self._t, 0.0)
            previous, self.category, self._t = self.category, category, now
            return previous

    def stalled(self, phase: str, seconds: float) -> None:
        """The watchdog fired: the stalled time leaves the category it was charged to."""
        self.switch(self.category)
        with self._lock:
            cat = self.category
            moved = min(seconds, self.seconds[cat])
            self.seconds[cat] -= moved
            self.seconds["stalled"] += moved

    def resumed_at(self, step: int) -> None:
        """This invocation starts at `step`: steps an earlier invocation finished beyond it are recomputed."""
        self.steps[0] = step
        last = [inv for inv in self.earlier if inv.get("last_step") is not None]
        if not last:
            return
        prev = last[-1]
        redo = int(prev["last_step"]) - step
        done = int(prev["last_step"]) - int(prev.get("first_step") or 0)
        if redo > 0 and done > 0:
            self.recomputed_steps = redo
            self.recomputed_s = redo * float(prev["seconds"].get("steps", 0.0)) / done

    def finished_step(self, step: int) -> None:
        """Records the step, written at once (a local file; on object storage at most every 30 s): an invocation
        killed without a word still says how far it got, so the resumed one counts the steps it recomputes."""
        self.steps[1] = step
        now = time.monotonic()
        if self.enabled and (not storage.is_remote(self.path) or now - self._written >= 30.0):
            self.write()

    def record(self, end: str = "open") -> dict:
        self.switch(self.category)
        with self._lock:
            wall = self._t - self.started
            return {
                "started_unix": round(self.started, 3),
                "ended_unix": round(self._t, 3),
                "wall_s": round(wall, 3),
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "first_step": self.steps[0],
                "last_step": self.steps[1],
                "recomputed_steps": self.recomputed_steps,
                "recomputed_s": round(self.recomputed_s, 3),
                "end": end,
            }

    def invocations(self, end: str = "open") -> list[dict]:
        return self.earlier + [self.record(end)]

    def write(self, end: str = "open") -> dict:
        """Writes every invocation's record (this one's so far, or how it ended); returns the totals."""
        assert end in ("open", "finished", "stalled", "error"), end
        invocations = self.invocations(end)
        if self.enabled:
            storage.write_text_atomic(self.path, json.dumps({"invocations": invocations}, indent=1))
            self._written = time.monotonic()
        return totals(invocations)


def scalars(t: dict) -> dict:
    """`totals` as TensorBoard scalars (goodput/*)."""
    return {
        "goodput/goodput": t["goodput"],
        **{f"goodput/{k}_s": v for k, v in t["seconds"].items()},
        "goodput/recomputed_s": t["recomputed_s"],
        "goodput/wall_s": t["wall_s"],
    }
