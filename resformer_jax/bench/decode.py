"""KV-cached decoding: tokens/s per variant, and a batch x context matrix against the memory bandwidth."""

from __future__ import annotations

import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from resformer_jax.model import Transformer
from resformer_jax.model.decode import generate, kv_cache_bytes_per_token


def bench_decode(cfg, context, new_tokens, batch) -> dict:

    cfg.model.max_seq_len = max(cfg.model.max_seq_len, context + new_tokens)
    model = Transformer(cfg.model)
    params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    prompt = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (batch, context), dtype=np.int32)
    generate(cfg.model, params, prompt[:, :16], max_new_tokens=2, max_len=context + new_tokens)  # compile small
    _, stats = generate(cfg.model, params, prompt, max_new_tokens=new_tokens, max_len=context + new_tokens)
    # A second run measures decoding without compilation.
    _, stats = generate(cfg.model, params, prompt, max_new_tokens=new_tokens, max_len=context + new_tokens)
    return {
        "variant": cfg.model.value_residual,
        "context": context,
        "new_tokens": new_tokens,
        "batch": batch,
        "kv_cache_bytes": stats["kv_cache_bytes"],
        "decode_tokens_per_s": round(stats["decode_tokens_per_s"], 2),
    }


def measure_copy_bandwidth(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s this device reads and writes in an elementwise pass (x + 1 over n_bytes of fp32), best of repeats."""

    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = max(best, 2 * n_bytes / (time.perf_counter() - t))
    return best


def bench_decode_matrix(cfgs, batches, contexts, new_tokens: int, rounds: int) -> list[dict]:
    """Decode tokens/s for every (batch, context) and variant, warm-up excluded, the variants taking turns; with
    the bytes a decode step reads (the weights once, every layer's cached K/V up to the mean context) and the
    fraction of the copy bandwidth that implies, so SVFormer's smaller cache shows as bytes and as time."""

    bandwidth = measure_copy_bandwidth()
    out = []
    for batch in batches:
        for context in contexts:
            runs = []
            for cfg in cfgs:
                m = cfg.copy_and_resolve_references().model
                m.max_seq_len = max(m.max_seq_len, context + new_tokens)
                params = nn.unbox(
                    jax.jit(Transformer(m).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
                )
                prompt = np.random.default_rng(0).integers(0, m.vocab_size, (batch, context), dtype=np.int32)
                generate(m, params, prompt, max_new_tokens=new_tokens, max_len=context + new_tokens)  # compile
                item = jnp.dtype(m.dtype).itemsize
                n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
                weights = (n - m.vocab_size * m.d_model) * item  # the embedding table: one row per token, not read
                cache = kv_cache_bytes_per_token(m) * batch * (context + new_tokens / 2)
                runs.append((m, params, prompt, weights, cache, []))
            for _ in range(rounds):
                for m, params, prompt, _, _, tps in runs:
                    _, st = generate(m, params, prompt, max_new_tokens=new_tokens, max_len=context + new_tokens)
                    tps.append(st["decode_tokens_per_s"])
            for m, _, _, weights, cache, tps in runs:
                med = statistics.median(tps)
                step_bytes = weights + cache  # one decode step serves `batch` tokens
                out.append(
                    {
                        "variant": m.value_residual,
                        "batch": batch,
                        "context": context,
                        "new_tokens": new_tokens,
                        "decode_tokens_per_s": round(med, 2),
                        "weight_bytes_per_step": int(weights),
                        "kv_cache_bytes_read_per_step": int(cache),
                        "bytes_read_per_token": round(step_bytes / batch, 1),
                        "memory_bandwidth_bytes_per_s": bandwidth,
                        "fraction_of_bandwidth": step_bytes * (med / batch) / bandwidth,
                    }
                )
    return out
