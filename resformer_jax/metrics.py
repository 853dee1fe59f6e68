"""Where a run's numbers go: TensorBoard (tensorboardX) and metrics.jsonl through `Writer`, the console
through `Progress`. The arithmetic behind them (FLOPs, MFU, memory) is perf.py's."""

from __future__ import annotations

import json
import os
import sys
import uuid

import numpy as np

from resformer_jax.errors import UserError
from resformer_jax.storage import read_lines


class Writer:
    """Scalars and text to TensorBoard; a no-op on processes other than 0."""

    def __init__(self, logdir: str, enabled: bool = True, jsonl=None, wandb: WandbSink | None = None):
        self.w, self.jsonl, self.wandb = None, None, wandb if enabled else None
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
        if self.wandb:
            self.wandb.scalars(step, values)

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
        if self.wandb:
            self.wandb.close()


class WandbSink:
    """Every scalar the Writer gets, also to Weights & Biases (process 0 only). The W&B run id is kept in the run
    directory (`id_file`), so a resumed or requeued run appends to the same W&B run; WANDB_MODE=offline writes
    the W&B files under `local_dir` without a network."""

    def __init__(self, project: str, id_file, local_dir: str, config: dict, name: str):
        import wandb

        from resformer_jax.storage import write_text_atomic

        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:8]  # W&B's own form: 8 lowercase alphanumerics
            write_text_atomic(id_file, run_id + "\n")
        os.makedirs(local_dir, exist_ok=True)
        self.run = wandb.init(
            project=project, id=run_id, resume="allow", dir=local_dir, config=config, name=name, reinit="create_new"
        )

    def scalars(self, step: int, values: dict):
        self.run.log({k: float(v) for k, v in values.items()}, step=int(step))

    def close(self):
        self.run.finish()


class MetricsFileError(UserError):
    """metrics.jsonl has a damaged line that is not the last one (a last line may still be being written)."""


def read_records(path, warn=None) -> list[dict]:
    """metrics.jsonl's records (local, or its segments on object storage). A half-written last line (a run training
    now, or killed mid-write) is left out, saying so through `warn`; a damaged line before it is an error naming
    the file and the line."""
    lines = read_lines(path)
    out = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or "step" not in rec:
                raise ValueError("not a metrics record")
        except ValueError:
            if i == len(lines) - 1:
                if warn:
                    warn(
                        f"note: {path}: the last line is incomplete (a run still writing, or killed mid-write); "
                        "read without it"
                    )
                break
            raise MetricsFileError(
                f"{path}: line {i + 1} is damaged ({line[:60]!r}); restore the file or remove that line"
            ) from None
        out.append(rec)
    return out


def read_jsonl(path, key: str, warn=None) -> dict:
    """{step: value} of one scalar from metrics.jsonl; a resumed run's later lines win."""
    return {rec["step"]: rec[key] for rec in read_records(path, warn) if key in rec}


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
        self.stream.write(
            f"step {step:>7}/{self.total}  loss {loss:7.4f}  {tokens_per_s:11,.0f} tok/s  ETA {fmt_eta(eta)}{extra}\n"
        )
        self.stream.flush()

    def message(self, text: str):
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()
