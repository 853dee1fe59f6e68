"""Attention impls timed forward and forward+backward at given shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from resformer_jax import perf
from resformer_jax.benchmarks.timing import median_seconds, random_qkv
from resformer_jax.kernels import attention as dispatch


def time_attention(f, shape, dtype, peak: float, repeats: int = 5, seed: int = 0) -> dict:
    """{fwd, fwd_bwd}: ms, TFLOP/s and fraction of `peak` of the attention function f(q, k, v) at `shape`."""
    q, k, v = random_qkv(shape, dtype, seed)
    B, T, H, _, D = shape
    fwd_flops, fwd_bwd_flops = perf.causal_attention_flops(B, T, H, D)
    fwd = jax.jit(f)
    bwd = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    out = {}
    for name, fn, flops in (("fwd", fwd, fwd_flops), ("fwd_bwd", bwd, fwd_bwd_flops)):
        s = median_seconds(fn, q, k, v, repeats=repeats)
        out[name] = {"ms": round(1e3 * s, 3), "tflops": flops / s / 1e12, "fraction_of_peak": flops / s / peak}
    return out


def bench_attention(shapes, impls, dtype) -> list[dict]:
    peak, src = perf.device_peak_flops()
    res = []
    for spec in shapes:
        shape = tuple(int(x) for x in spec.split(","))
        for impl in impls:
            try:
                times = time_attention(
                    lambda q, k, v, impl=impl: dispatch.attention(q, k, v, impl=impl), shape, dtype, peak
                )
                res.append(
                    {
                        "impl": impl,
                        "shape": list(shape),
                        "dtype": str(dtype.__name__ if hasattr(dtype, "__name__") else dtype),
                        **times,
                        "peak_source": src,
                    }
                )
            except Exception as e:
                res.append({"impl": impl, "shape": list(shape), "error": f"{type(e).__name__}: {e}"[:300]})
    return res
