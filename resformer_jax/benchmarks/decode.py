"""Decoding through the engine: tokens/s per variant, a batch x context matrix against the memory bandwidth, and a
stream of requests of mixed lengths at one cache budget (time to first token, inter-token latency, how many
sequences the budget held at once)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from resformer_jax.engine import Engine, SamplingParams
from resformer_jax.engine.engine import DECODE_STEPS, EngineStats
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.transformer import cache_bytes_per_token
from resformer_jax.resolve import for_backend


def random_params(m: ModelConfig):
    return nn.unbox(
        jax.jit(Transformer(for_backend(m)).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    )


def kv_bytes_read_per_token(m: ModelConfig) -> int:
    """What one cached token costs a decode step to read: every layer reads K and the V it attends over (SVFormer's
    layers >= 2 read V_1, SkipV1Former's layer 1's heads: a cache shared across layers is held once but read by
    each layer, whose attention matrices differ)."""
    return 2 * m.num_layers * m.kv_heads * m.head_dim * jnp.dtype(m.dtype).itemsize


def weight_bytes_read(m: ModelConfig, params) -> int:
    """The weights a decode step reads, as the engine holds them (engine.serving_params: bf16 on an accelerator,
    fp32 on a CPU): all but the embedding table (one row a token)."""
    n = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    return n - m.vocab_size * m.d_model * params["embed"]["embedding"].dtype.itemsize


PREFILL_CHUNK, PREFILL_ROWS = 512, 4  # steady_decode's engine
GREEDY = SamplingParams()  # the benches' requests unless told (frozen: a default shared safely)


def request_sampling(sampling: SamplingParams, i: int, max_tokens: int) -> SamplingParams:
    """A bench's request i: `sampling` with its max tokens, seeded sampling.seed + i (rows draw apart)."""
    return dataclasses.replace(sampling, max_tokens=max_tokens, seed=sampling.seed + i)


def tokens_asked(batch: int, context: int, new_tokens: int, decode_steps: int) -> int:
    """The tokens steady_decode's requests ask for: the timed ones, the untimed run that compiles, and the single
    steps the first rows take while the others' prompts are read (one a prefill step)."""
    prefill_steps = -(-batch // PREFILL_ROWS) * -(-context // PREFILL_CHUNK)
    return new_tokens + 2 * decode_steps + prefill_steps + 1


def steady_decode(
    m,
    params,
    batch: int,
    context: int,
    new_tokens: int,
    page_size: int = 16,
    prefill: bool = True,
    decode_steps: int = DECODE_STEPS,
    sampling: SamplingParams = GREEDY,
) -> dict:
    """`batch` requests of `context` prompt tokens prefilled, then about `new_tokens` decode steps timed, every
    row `decode_steps` at a time (the first such run, which compiles, excluded; the timing stops before a row
    would take fewer, which would run and compile a shorter program). prefill=False: each request's pages are
    taken and its prompt counted as cached without running the prompt (the pages hold zeros: a decode step reads
    the same bytes), which times large batches and contexts on a CPU in seconds instead of the prefill's
    minutes. Each request decodes as `sampling` says (request_sampling)."""
    asked = tokens_asked(batch, context, new_tokens, decode_steps)
    need = (batch + 1) * (context + asked + page_size) * cache_bytes_per_token(m)
    sizes: dict[str, Any] = dict(
        page_size=page_size, max_batch=batch, prefill_chunk=PREFILL_CHUNK, prefill_rows=PREFILL_ROWS
    )
    engine = Engine(m, params, cache_bytes=need, decode_steps=decode_steps, **sizes)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, m.vocab_size, context).tolist() for _ in range(batch)]
    reqs = [engine.submit(p, request_sampling(sampling, i, asked)) for i, p in enumerate(prompts)]
    if not prefill:
        engine.skip_prefill()
    while any(r.state in ("waiting", "prefill") for r in reqs):
        engine.step()
    k = engine.decode_steps
    while engine.stats.decode_steps < k or min(len(r.tokens) for r in reqs) < k + 1:
        engine.step()  # the first run of k steps compiles
    s0, t0, rows0 = engine.stats.decode_steps, engine.stats.decode_seconds, engine.stats.decode_rows
    pages0 = engine.stats.decode_pages_read
    left = lambda: min(asked - len(r.tokens) for r in reqs)
    while engine.stats.decode_steps - s0 < new_tokens and left() >= k:
        engine.step()
    steps = engine.stats.decode_steps - s0
    seconds = engine.stats.decode_seconds - t0
    if steps == 0:
        raise RuntimeError(f"steady_decode timed no step: {asked} tokens asked, {left()} left")
    tokens_in_cache = (engine.stats.decode_pages_read - pages0) * page_size / steps  # filled pages a step
    result = {
        "steps": steps,
        "seconds": seconds,
        "tokens_per_s": (engine.stats.decode_rows - rows0) / max(seconds, 1e-9),
        "step_s": seconds / steps,
        "cached_tokens_per_step": tokens_in_cache,
        "cache_bytes_held_per_token": engine.bytes_per_token,
        "weight_bytes_per_step": weight_bytes_read(m, engine.runner.params),
        "decode_steps_per_readback": k,
        "compiled_shapes": len(engine.stats.compiled_shapes),
    }
    for r in reqs:
        engine.cancel(r)
    return result


def describe_sampling(sampling: SamplingParams) -> str:
    """How a bench's requests decoded, for its rows: "greedy", or the sampling knobs that are on."""
    on = [f"temperature {sampling.temperature:g}"] if sampling.temperature else ["greedy"]
    on += [f"top_k {sampling.top_k}"] if sampling.top_k and sampling.temperature else []
    on += [f"top_p {sampling.top_p:g}"] if sampling.top_p < 1 and sampling.temperature else []
    on += [f"min_p {sampling.min_p:g}"] if sampling.min_p and sampling.temperature else []
    for name, off in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        on += [f"{name} {getattr(sampling, name):g}"] if getattr(sampling, name) != off else []
    return ", ".join(on)


def bench_decode(model: ModelConfig, context, new_tokens, batch, sampling: SamplingParams = GREEDY) -> dict:
    m = model.replace(
        max_seq_len=max(model.max_seq_len, context + tokens_asked(batch, context, new_tokens, DECODE_STEPS))
    )
    r = steady_decode(m, random_params(m), batch, context, new_tokens, sampling=sampling)
    return {
        "variant": m.value_residual,
        "context": context,
        "new_tokens": new_tokens,
        "batch": batch,
        "sampling": describe_sampling(sampling),
        "kv_cache_bytes_per_token": r["cache_bytes_held_per_token"],
        "kv_cache_bytes": r["cache_bytes_held_per_token"] * batch * (context + new_tokens),  # what the batch holds
        "decode_tokens_per_s": round(r["tokens_per_s"], 2),
    }


def measure_copy_bandwidth(n_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s this device reads and writes in an elementwise pass (x + 1 over n_bytes of fp32, in place), best of
    repeats. In place: a fresh output would be paid in the operating system's first touch of its pages (on a
    2-core CPU that measured 5 GB/s against 32 GB/s in place) and flatter every fraction measured against it."""
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = f(jnp.ones((n_bytes // 4,), jnp.float32))
    x.block_until_ready()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        x = f(x)
        x.block_until_ready()
        best = max(best, 2 * n_bytes / (time.perf_counter() - t))
    return best


def measure_read_bandwidth(n_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s this device reads in a reduction over n_bytes of fp32, best of repeats and of three forms of the sum
    (XLA:CPU's speed depends on which emitter takes a reduction's shape: 17 to 27 GB/s on 2 cores for the same
    bytes): what a step that only reads (a decode step's weights and cache) can reach. On a 2-core CPU it measured
    25-30 GB/s beside a copy's 40 GB/s read and written: a read-only step reaches about 0.7 of the copy figure."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    best = 0.0
    for form in (jnp.sum, lambda a: a.reshape(-1, 8).sum(0), lambda a: a.reshape(-1, 1024).sum(1)):
        f = jax.jit(form)
        f(x).block_until_ready()
        for _ in range(repeats):
            t = time.perf_counter()
            f(x).block_until_ready()
            best = max(best, n_bytes / (time.perf_counter() - t))
    return best


def bench_decode_matrix(
    models: list[ModelConfig],
    batches,
    contexts,
    new_tokens: int,
    rounds: int,
    prefill: bool = True,
    log=lambda m: print(m, file=sys.stderr),
    decode_steps: int = DECODE_STEPS,
    sampling: SamplingParams = GREEDY,
) -> Iterator[dict]:
    """Engine decode tokens/s for every (batch, context) and variant, the variants taking turns round by round;
    with the bytes a step reads (the weights once; each layer's K and attended V over the filled pages) and the
    fraction of this process's copy bandwidth that implies, and of its read bandwidth (a decode step only reads);
    and the cache each variant holds a token. Every request decodes as `sampling` says (greedy by default).
    prefill=False: the prompts' pages taken, not computed (steady_decode). Rows are yielded as each (batch,
    context) finishes, and each phase's seconds logged, so a run cut short keeps what it measured."""
    t0 = time.perf_counter()
    bandwidth, reads = measure_copy_bandwidth(), measure_read_bandwidth()
    log(
        f"bench decode: copy bandwidth {bandwidth / 1e9:.1f} GB/s (read and written), read bandwidth "
        f"{reads / 1e9:.1f} GB/s, measured in {time.perf_counter() - t0:.1f} s"
    )
    longest = max(c + tokens_asked(max(batches), c, new_tokens, decode_steps) for c in contexts)
    runs = []  # parameters built once per variant, at the longest context
    for model in models:
        t0 = time.perf_counter()
        m = model.replace(max_seq_len=max(model.max_seq_len, longest))
        runs.append((m, random_params(m)))
        log(f"bench decode {m.value_residual}: parameters built in {time.perf_counter() - t0:.1f} s")
    decode = functools.partial(steady_decode, prefill=prefill, decode_steps=decode_steps, sampling=sampling)
    for batch in batches:
        for context in contexts:
            measured: list[list[dict]] = [[] for _ in runs]
            for _ in range(rounds):
                for (m, params), res in zip(runs, measured):
                    t0 = time.perf_counter()
                    res.append(decode(m, params, batch, context, new_tokens))
                    log(
                        f"bench decode {m.value_residual} batch {batch} context {context}: "
                        f"{time.perf_counter() - t0:.1f} s ({res[-1]['step_s'] * 1e3:.2f} ms a step)"
                    )
            for (m, _), results in zip(runs, measured):
                step_s = statistics.median(r["step_s"] for r in results)
                cached = results[0]["cached_tokens_per_step"]
                weights = results[0]["weight_bytes_per_step"]
                cache = kv_bytes_read_per_token(m) * cached
                yield (
                    {
                        "variant": m.value_residual,
                        "batch": batch,
                        "context": context,
                        "new_tokens": new_tokens,
                        "sampling": describe_sampling(sampling),
                        "decode_tokens_per_s": round(batch / step_s, 2),
                        "step_ms": round(step_s * 1e3, 2),
                        "weight_bytes_per_step": int(weights),
                        "kv_bytes_read_per_step": int(cache),
                        "kv_cache_bytes_held_per_token": results[0]["cache_bytes_held_per_token"],
                        "memory_bandwidth_bytes_per_s": bandwidth,
                        "fraction_of_bandwidth": round((weights + cache) / step_s / bandwidth, 3),
                        "read_bandwidth_bytes_per_s": reads,
                        "fraction_of_read_bandwidth": round((weights + cache) / step_s / reads, 3),
                        "compiled_shapes": results[0]["compiled_shapes"],
                        "decode_steps_per_readback": results[0]["decode_steps_per_readback"],
                    }
                )


def _stream_row(m, engine, reqs, prompts, wall: float, cache_gib: float, rate: float, sampling, prefix: tuple) -> dict:
    """bench_decode_stream's row for one variant: the timed pass's requests, latencies and the engine's counts."""
    ttft = [r.time_to_first_token_s for r in reqs]
    itl = [d for r in reqs for d in r.inter_token_s]
    tpot = [t for r in reqs if (t := r.time_per_output_token_s) is not None]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")
    return {
        "variant": m.value_residual,
        "cache_gib": cache_gib,
        "cache_pages": engine.pool.usable,
        "kv_cache_bytes_held_per_token": engine.bytes_per_token,
        "requests": len(reqs),
        "rate": rate,
        "sampling": describe_sampling(sampling),
        "tokens_per_s": round(sum(len(r.tokens) for r in reqs) / wall, 2),
        **{
            f"{name}_p{q}_s": round(pct(xs, q), digits)
            for name, xs, digits in (("ttft", ttft, 3), ("itl", itl, 4), ("tpot", tpot, 4))
            for q in (50, 99)
        },
        "most_concurrent": engine.stats.most_concurrent,
        "preemptions": engine.stats.preemptions,
        "compiled_shapes": len(engine.stats.compiled_shapes),
        "prompt_tokens": sum(len(p) for p in prompts),
        "prefill_tokens_computed": engine.stats.prefill_tokens,
        **(dict(zip(("shared_prefixes", "prefix_len", "prefix_cache"), prefix)) if prefix[0] else {}),
        "prefix_hit_rate": round(engine.stats.prefix_hits / max(engine.stats.prefix_queries, 1), 4),
    }


def bench_decode_stream(
    models: list[ModelConfig],
    cache_gib: float,
    requests: int,
    rate: float,
    max_context: int,
    new_tokens: int,
    seed: int = 0,
    decode_steps: int = DECODE_STEPS,
    sampling: SamplingParams = GREEDY,
    shared_prefixes: int = 0,
    prefix_len: int = 0,
    prefix_cache: bool = True,
    prompt_min: int = 16,
) -> list[dict]:
    """One stream of `requests` (prompts of prompt_min..max_context tokens, up to `new_tokens` new ones each, Poisson
    arrivals at `rate` a second; rate 0: all at once) through each variant's engine with the same cache budget:
    tokens/s, time to first token, inter-token latency and time per output token (p50, p99; tokens come k decode
    steps a readback, so most inter-token gaps are 0), the most sequences held at once, and the prompt tokens
    computed. Every request decodes as `sampling` says (request_sampling). With `shared_prefixes` N > 0, the
    prefix benchmarks' workload: request i's prompt is prefix i % N (of `prefix_len` tokens) then its own suffix,
    and the prefix cache's hit rate is reported."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_min, max_context + 1, requests)
    arrivals = np.cumsum(rng.exponential(1 / rate, requests)) if rate > 0 else np.zeros(requests)
    prefix = (shared_prefixes, prefix_len, prefix_cache)
    out = []
    for model in models:
        longest = max_context + new_tokens + (prefix_len if shared_prefixes else 0)
        m = model.replace(max_seq_len=max(model.max_seq_len, longest))
        params = random_params(m)
        budget: dict[str, Any] = dict(cache_bytes=cache_gib * 2**30, max_batch=256, prefill_chunk=256)
        engine = Engine(m, params, decode_steps=decode_steps, prefix_cache=prefix_cache, **budget)
        for _ in range(2):  # the stream twice: the first compiles the shapes it meets, untimed
            # fresh tokens each pass: the second's prompts are not in the prefix cache the first filled
            prompts = [rng.integers(0, m.vocab_size, n).tolist() for n in lengths]
            if shared_prefixes:
                prefixes = [rng.integers(0, m.vocab_size, prefix_len).tolist() for _ in range(shared_prefixes)]
                prompts = [prefixes[i % shared_prefixes] + p for i, p in enumerate(prompts)]
            engine.stats = EngineStats()
            reqs: list = []
            t0, queued = time.perf_counter(), list(zip(arrivals, prompts))
            while queued or engine.busy:
                now = time.perf_counter() - t0
                while queued and queued[0][0] <= now:
                    reqs.append(engine.submit(queued.pop(0)[1], request_sampling(sampling, len(reqs), new_tokens)))
                if engine.busy:
                    engine.step()
                elif queued:
                    time.sleep(min(0.01, queued[0][0] - now))
            wall = time.perf_counter() - t0
        out.append(_stream_row(m, engine, reqs, prompts, wall, cache_gib, rate, sampling, prefix))
    return out
