"""Probing, apart from dispatch (kernels/attention.py): what each `auto` kernel choice resolves to on a backend, and
the timings that decide it at a run's shapes (resolve.py calls these once a start): the attention impl
(`probe_auto`; `unprobed_auto` where nothing is timed) and, on a GPU, the norm (`probe_norm`)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import resformer_jax.kernels as kernels
from resformer_jax.errors import one_line
from resformer_jax.kernels import attention as dispatch
from resformer_jax.kernels.names import auto_candidates


def probe_norm(rows: int, d_model: int, dtype, log_fn=print, repeats: int = 3, clock=time.perf_counter) -> str:
    """model.norm_impl=auto on a GPU: 'pallas' or 'xla', whichever runs RMSNorm forward + backward faster at the run's
    rows (a device's tokens a microbatch) and width, as a layer runs it (the stream passed through, y to two groups of
    consumers, real cotangents). Kernels that fail fall back to XLA's norm, the reason logged."""
    h = jnp.full((1, rows, d_model), 0.1, dtype)
    scale = jnp.ones((d_model,), jnp.float32)
    cotangents = tuple(jnp.full((1, rows, d_model), 0.01 * (i + 1), dtype) for i in range(3))

    def plain(h, scale):
        y = kernels.plain_rms_norm(h, scale, 1e-5, dtype)
        return h, y, y

    def in_kernels(h, scale):
        return kernels.rms_norm(h, scale, eps=1e-5, out_dtype=dtype, passes=True, outputs=2)

    seconds: dict[str, float] = {}
    failed = ""
    for impl, fn in (("pallas", in_kernels), ("xla", plain)):

        def fwd_bwd(h, scale, cts, fn=fn):
            outs, vjp = jax.vjp(fn, h, scale)
            return outs[1], vjp(cts)

        step = jax.jit(fwd_bwd)
        try:
            jax.block_until_ready(step(h, scale, cotangents))  # compiles
        except Exception as e:
            failed = f"; the kernels failed ({one_line(e, 200)})"
            continue
        best = float("inf")
        for _ in range(repeats):
            t0 = clock()
            jax.block_until_ready(step(h, scale, cotangents))
            best = min(best, clock() - t0)
        seconds[impl] = best
    choice = min(seconds, key=lambda k: seconds[k])
    times = "".join(f"; {k} {v * 1e3:.3f} ms" for k, v in seconds.items())
    log_fn(f"model.norm_impl=auto chose {choice!r} (faster forward+backward at {rows} x {d_model}{times}){failed}")
    return choice


def probe_auto(
    q_shape,
    kv_heads,
    dtype,
    log_fn=print,
    backend: str | None = None,
    repeats: int = 3,
    clock=time.perf_counter,
    documents: bool = False,
    value_mix: bool = False,
):
    """The impl `auto` resolves to at the real shapes: every candidate that compiles and runs forward+backward.
    value_mix (ResFormer's Eq. 7 layers): each candidate is timed on what such a layer runs, pallas forming the
    mix as it loads V and the others attending over the value mixed first (a pass of its own, timed with them).

    On an accelerator (GPU: pallas, cudnn, xla; TPU: splash, xla) each one that runs is timed (the best of
    `repeats` runs after its compile) and the fastest is kept, each time logged; on a CPU the first that runs
    (chunked, causal blocks in plain XLA ops, is faster than xla there). `backend` defaults to JAX's default
    backend (tests inject one). Returns (choice, {rejected impl: reason}); it records nothing: the caller carries
    the choice into the model's config (resolve.py).
    """
    backend = backend or jax.default_backend()
    candidates, rejected = auto_candidates(backend, documents)
    timed = backend in ("gpu", "tpu")
    B, T, H, D = q_shape
    seconds: dict[str, float] = {}
    for impl in candidates:
        try:
            q = jnp.ones((B, T, H, D), dtype) * 0.1
            kv = jnp.ones((B, T, kv_heads, D), dtype) * 0.1

            def loss(q, k, v, v1, impl=impl):
                lam = jnp.array([0.5, 0.5], jnp.float32)
                if not value_mix:
                    out = dispatch.attention(q, k, v, causal=True, impl=impl)
                elif impl == "pallas":
                    out = dispatch.attention(q, k, v, causal=True, impl=impl, value_mix=(v1, lam), lambda_grads=False)
                else:  # the model's Eq. 7 before the attention
                    out = dispatch.attention(q, k, (lam[0] * v1 + lam[1] * v).astype(v.dtype), causal=True, impl=impl)
                return out.astype(jnp.float32).sum()

            step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
            jax.block_until_ready(step(q, kv, kv, kv))  # compiles
        except Exception as e:
            rejected[impl] = one_line(e, 200)
            continue
        if not timed:
            seconds[impl] = 0.0
            break
        best = float("inf")
        for _ in range(repeats):
            t0 = clock()
            jax.block_until_ready(step(q, kv, kv, kv))
            best = min(best, clock() - t0)
        seconds[impl] = best
    if not seconds:
        raise kernels.KernelUnavailable(f"no attention impl runs here: {rejected}")
    choice = min(seconds, key=lambda k: seconds[k])
    times = "".join(f"; {k} {v * 1e3:.2f} ms" for k, v in seconds.items()) if timed else ""
    mixed = " with ResFormer's value mix (pallas forms it in the kernel, the others after a pass)" if value_mix else ""
    msg = (
        f"attention_impl=auto chose {choice!r}"
        + (f" (fastest forward+backward at {q_shape}{mixed}{times})" if timed else "")
        + "".join(f"; rejected {k}: {v}" for k, v in rejected.items())
    )
    log_fn(msg)
    return choice, rejected
