"""What every benchmark times with: the median of repeated calls after a warm-up, and random inputs."""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from resformer_jax.perf import packed_documents


def median_seconds(fn, *args, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of `fn(*args)` (blocked until its outputs are ready) over `repeats` calls after
    `warmup` calls (which compile)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def random_qkv(shape, dtype, seed: int = 0):
    """q [B, T, H, D], k and v [B, T, K, D] for an attention shape (B, T, H, K, D), standard normal."""
    B, T, H, K, D = shape
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        jax.random.normal(ks[0], (B, T, H, D), dtype),
        jax.random.normal(ks[1], (B, T, K, D), dtype),
        jax.random.normal(ks[2], (B, T, K, D), dtype),
    )


def random_tokens(shape, vocab_size: int, sharding=None, seed: int = 0, document_len: int = 0):
    """Uniform token ids of `shape` (int32), placed with `sharding` when given. document_len > 0: packed
    documents of that mean length (geometric), each ended by the last id (vocab_size - 1, which the uniform
    ids leave out): what a prepared corpus's rows look like to a document mask."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size - (document_len > 0), shape, dtype=np.int32)
    if document_len > 0:
        ends = packed_documents(shape[-1], document_len, int(np.prod(shape[:-1])), seed + 1).reshape(shape)
        tokens[ends > 0] = vocab_size - 1
    return jax.device_put(tokens, sharding) if sharding is not None else tokens
