"""Where a run's numbers go: TensorBoard (tensorboardX) and metrics.jsonl through `Writer`, the console
through `Progress`. The arithmetic behind them (FLOPs, MFU, memory) is perf.py's."""
from __future__ import annotations

import json
import os
import sys

import numpy as np


class Writer:
    """Scalars and text to TensorBoard; a no-op on processes other than 0."""

    def __init__(self, logdir: str, enabled: bool = True, jsonl=None):
        self.w, self.jsonl = None, None
        if enabled:
            from tensorboardX import SummaryWriter
            from resformer_jax.storage import tensorboard_writers_for
            tensorboard_writers_for(logdir)  # gs:// and s3:// event files through epath
            self.w = SummaryWriter(os.fspath(logdir), flush_secs=10)
            if jsonl:  # the same scalars, machine-readable: one JSON object per logged step
                from resformer_jax.storage import LineLog
                self.jsonl = LineLog(jsonl)

    def scalars(self, step: int, values: dict):
        if self.w:
            for k, v in values.items():
                self.w.add_scalar(k, float(v), step)
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": int(step), **{k: float(v) for k, v in values.items()}}))

    def text(self, tag: str, text: str, step: int = 0):
        if self.w:
            self.w.add_text(tag, text, step)

    def flush(self):
        if self.w:
            self.w.flush()

    def close(self):
        if self.w:
            self.w.close()
        if self.jsonl:
            self.jsonl.close()


def read_jsonl(path, key: str) -> dict:
    """{step: value} of one scalar from metrics.jsonl (local, or its segments on object storage); a
    resumed run's later lines win."""
    from resformer_jax.storage import read_lines
    out = {}
    for line in read_lines(path):
        rec = json.loads(line)
        if key in rec:
            out[rec["step"]] = rec[key]
    return out


def fmt_eta(seconds: float) -> str:
    if not np.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """One compact console line per log interval: step, loss, tokens/s, ETA."""

    def __init__(self, total_steps: int, enabled: bool = True, stream=None):
        self.total, self.enabled, self._stream = total_steps, enabled, stream

    @property
    def stream(self):
        return self._stream or sys.stdout

    def update(self, step: int, loss: float, tokens_per_s: float, step_time: float, extra: str = ""):
        if not self.enabled:
            return
        eta = (self.total - step) * step_time
        self.stream.write(f"step {step:>7}/{self.total}  loss {loss:7.4f}  {tokens_per_s:11,.0f} tok/s  "
                          f"ETA {fmt_eta(eta)}{extra}\n")
        self.stream.flush()

    def message(self, text: str):
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()
