"""Faults injected on purpose, to check what a run does about them: the tests, and users checking that their
launcher and scheduler handle a stalled process. Read once from the environment when training starts; unset,
they change nothing.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np

BLOCK_ENV = "RESFORMER_TEST_BLOCK_DATA"
NOISE_ENV = "RESFORMER_TEST_NOISE_BATCH"
SLOW_EVAL_ENV = "RESFORMER_TEST_SLOW_EVAL"


@dataclasses.dataclass(frozen=True)
class Faults:
    block_at: int | None = None  # the 1-based step whose data read blocks in this process
    block_s: float = float("inf")
    noise_at: frozenset[int] = frozenset()
    slow_eval: tuple[int, float] | None = None  # (from step, extra seconds a validation batch)

    @classmethod
    def from_env(cls, process_index: int, environ=os.environ) -> Faults:
        block_at, block_s = None, float("inf")
        spec = environ.get(BLOCK_ENV, "").strip()
        if spec:
            parts = spec.split(":")
            process = int(parts[1]) if len(parts) > 1 and parts[1] != "" else process_index
            if process == process_index:
                block_at = int(parts[0])
                block_s = float(parts[2]) if len(parts) > 2 else float("inf")
        noise = frozenset(int(x) for x in environ.get(NOISE_ENV, "").replace(" ", "").split(",") if x)
        slow = environ.get(SLOW_EVAL_ENV, "").strip()
        slow_eval = (int(slow.split(":")[0]), float(slow.split(":")[1])) if slow else None
        return cls(block_at, block_s, noise, slow_eval)

    def eval_batch(self, step: int) -> None:
        """Before each validation batch at `step`."""
        if self.slow_eval is not None and step >= self.slow_eval[0]:
            if step not in _SAID:
                _SAID.add(step)
                print(f"test fault: the validation at step {step} is slowed", file=sys.stderr, flush=True)
            time.sleep(self.slow_eval[1])

    def before_read(self, step: int) -> None:
        if self.block_at == step:
            _blocked_read(self.block_s)

    def batch(self, step: int, local: np.ndarray, vocab_size: int) -> np.ndarray:
        if step not in self.noise_at:
            return local
        rng = np.random.default_rng(step)  # the same noise on a rerun: a resume replays the spike exactly
        return rng.integers(0, vocab_size, size=local.shape).astype(local.dtype)


_SAID: set[int] = set()  # steps whose slowed validation was said (a test's marker; faults are never on in a run)


def _blocked_read(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
