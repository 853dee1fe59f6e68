"""The training input pipeline (mixture, this host's slice, grain threads, prefetch) as training reads it."""

from __future__ import annotations

import statistics
import time

import jax

from resformer_jax.benchmarks.train import TrainBench
from resformer_jax.data.pipeline import train_iterator
from resformer_jax.resolve import check


def bench_data(cfg, steps: int, step_tokens_per_s: float = 0.0) -> dict:
    """The training iterator (mixture, this host's slice, grain threads and prefetch) as training reads it:
    batches per second after a warm-up, against the tokens per second the train step consumes."""
    check(cfg)
    it = train_iterator(cfg, jax.process_index(), jax.process_count())
    for _ in range(3):  # threads started, prefetch buffer filled
        next(it)
    t = time.perf_counter()
    for _ in range(steps):
        batch = next(it)
    dt = time.perf_counter() - t
    local_tokens = batch.shape[0] * (batch.shape[1] - 1)
    tps = steps * local_tokens / dt
    out = {
        "source": cfg.data.source,
        "global_batch": cfg.train.global_batch,
        "seq_len": cfg.data.seq_len,
        "processes": jax.process_count(),
        "threads": cfg.data.num_threads,
        "prefetch": cfg.data.prefetch,
        "batches": steps,
        "loader_tokens_per_s_per_host": round(tps, 1),
        "loader_batches_per_s": round(steps / dt, 2),
    }
    if step_tokens_per_s <= 0:
        b = TrainBench(cfg)
        b.warm_up(1)
        for _ in range(3):
            b.timed_step()
        step_tokens_per_s = cfg.train.global_batch * cfg.data.seq_len / statistics.median(b.times)
        out["step_source"] = "timed here (3 steps)"
    else:
        out["step_source"] = "--step_tokens_per_s"
    per_host = step_tokens_per_s / jax.process_count()
    out.update(step_tokens_per_s=round(step_tokens_per_s, 1), loader_over_step=round(tps / per_host, 2))
    return out
