"""RMSNorm as Pallas kernels for NVIDIA GPUs (Triton), with a custom VJP: one read of the residual stream forward,
one pass backward that also adds the gradient the residual stream carries past the norm.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from resformer_jax.kernels.pallas_attention import gpu_pallas_call

ROWS = 8  # rows a program holds at once: [8, 1024] fp32 is 32 values a thread at 8 warps, three of them live
CHUNKS = 8  # blocks of ROWS a backward program walks, summing its share of d scale in registers
WARPS = 8


def _fwd_kernel(h_ref, scale_ref, *out_refs, eps):
    y_ref, rstd_ref, *copy_ref = out_refs
    h = h_ref[...]
    if copy_ref:
        copy_ref[0][...] = h
    h_RxE = h.astype(jnp.float32)
    rstd_Rx1 = lax.rsqrt(jnp.mean(h_RxE * h_RxE, axis=1, keepdims=True) + eps)
    y_ref[...] = (h_RxE * rstd_Rx1 * scale_ref[...][None, :]).astype(y_ref.dtype)
    rstd_ref[...] = rstd_Rx1[:, 0]


def _bwd_kernel(*refs, chunks, passes, outputs):
    h_ref, rstd_ref, scale_ref, *dy_refs = refs[: 3 + outputs]
    dpass_ref = refs[3 + outputs] if passes else None
    dh_ref, dscale_ref = refs[-2:]
    scale_1xE = scale_ref[...][None, :]

    def chunk(c, dscale_1xE):
        rows = pl.ds(c * ROWS, ROWS)
        rstd_Rx1 = rstd_ref[rows][:, None]
        xhat_RxE = h_ref[rows, :].astype(jnp.float32) * rstd_Rx1
        dy_RxE = sum(dy_ref[rows, :].astype(jnp.float32) for dy_ref in dy_refs)
        g_RxE = dy_RxE * scale_1xE
        dx_RxE = rstd_Rx1 * (g_RxE - xhat_RxE * jnp.mean(g_RxE * xhat_RxE, axis=1, keepdims=True))
        if dpass_ref is not None:
            dx_RxE = dx_RxE + dpass_ref[rows, :].astype(jnp.float32)
        dh_ref[rows, :] = dx_RxE.astype(dh_ref.dtype)
        return dscale_1xE + jnp.sum(dy_RxE * xhat_RxE, axis=0, keepdims=True)

    dscale_ref[...] = lax.fori_loop(0, chunks, chunk, jnp.zeros(dscale_ref.shape, jnp.float32))


def _rows_per_program(n: int, cap: int) -> int:
    """Rows a program takes: ROWS times the largest power-of-two count of ROWS blocks up to `cap` dividing n."""
    c = cap
    while c > 1 and n % (ROWS * c):
        c //= 2
    return ROWS * c


def _padded(x_NxE, rows: int):
    pad = -x_NxE.shape[0] % rows
    return x_NxE if pad == 0 else jnp.pad(x_NxE, ((0, pad), (0, 0)))


def _forward(h_NxE, scale_E, eps, out_dtype, copy: bool = False):
    """(y, rstd), and with copy=True a copy of h: the stream's next residual add accumulates into it in place
    (a GEMM's C operand) while h stays for the backward, where XLA would otherwise copy h in a pass of its own."""
    N, E = h_NxE.shape
    hp = _padded(h_NxE, ROWS)
    Np = hp.shape[0]
    block = pl.BlockSpec((ROWS, E), lambda i: (i, 0))
    copied = [jax.ShapeDtypeStruct((Np, E), h_NxE.dtype)] if copy else []
    outs = gpu_pallas_call(
        functools.partial(_fwd_kernel, eps=eps),
        num_warps_=WARPS,
        grid=(Np // ROWS,),
        in_specs=[block, pl.BlockSpec((E,), lambda i: (0,))],
        out_specs=[block, pl.BlockSpec((ROWS,), lambda i: (i,))] + ([block] if copy else []),
        out_shape=[jax.ShapeDtypeStruct((Np, E), out_dtype), jax.ShapeDtypeStruct((Np,), jnp.float32), *copied],
        name="rms_norm_fwd",
    )(hp, scale_E)
    return tuple(o[:N] for o in outs)


def _backward(h_NxE, rstd_N, scale_E, dys, dpass_NxE):
    """dys: y's cotangents, one per consumer of y (summed here rather than by a pass of XLA's)."""
    N, E = h_NxE.shape
    rows = _rows_per_program(-(-N // ROWS) * ROWS, CHUNKS)
    passes = dpass_NxE is not None
    ins = [_padded(h_NxE, rows), _padded(rstd_N[:, None], rows)[:, 0], scale_E, *(_padded(d, rows) for d in dys)]
    if passes:
        ins.append(_padded(dpass_NxE, rows))
    Np = ins[0].shape[0]
    block = pl.BlockSpec((rows, E), lambda i: (i, 0))
    dh, dscale_parts = gpu_pallas_call(
        functools.partial(_bwd_kernel, chunks=rows // ROWS, passes=passes, outputs=len(dys)),
        num_warps_=WARPS,
        grid=(Np // rows,),
        in_specs=[block, pl.BlockSpec((rows,), lambda i: (i,)), pl.BlockSpec((E,), lambda i: (0,))]
        + [block] * (len(dys) + passes),
        out_specs=[block, pl.BlockSpec((1, E), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((Np, E), h_NxE.dtype), jax.ShapeDtypeStruct((Np // rows, E), jnp.float32)],
        name="rms_norm_bwd",
    )(*ins)
    return dh[:N], jnp.sum(dscale_parts, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _norm(h_NxE, scale_E, eps, out_dtype):
    return _forward(h_NxE, scale_E, eps, out_dtype)[0]


def _norm_fwd(h_NxE, scale_E, eps, out_dtype):
    y, rstd = _forward(h_NxE, scale_E, eps, out_dtype)
    return y, (h_NxE, rstd, scale_E)


def _norm_bwd(eps, out_dtype, res, dy):
    h, rstd, scale = res
    dh, dscale = _backward(h, rstd, scale, [dy], None)
    return dh, dscale.astype(scale.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _norm_passing(h_NxE, scale_E, eps, out_dtype, outputs):
    y, _, h_copy = _forward(h_NxE, scale_E, eps, out_dtype, copy=True)
    return (h_copy,) + (y,) * outputs


def _norm_passing_fwd(h_NxE, scale_E, eps, out_dtype, outputs):
    y, rstd, h_copy = _forward(h_NxE, scale_E, eps, out_dtype, copy=True)
    return (h_copy,) + (y,) * outputs, (h_NxE, rstd, scale_E)


def _norm_passing_bwd(eps, out_dtype, outputs, res, cotangents):
    h, rstd, scale = res
    dpass, *dys = cotangents
    dh, dscale = _backward(h, rstd, scale, dys, dpass)
    return dh, dscale.astype(scale.dtype)


_norm_passing.defvjp(_norm_passing_fwd, _norm_passing_bwd)


def rms_norm(h_BxTxE, scale_E, *, eps: float, out_dtype, passes: bool = False, outputs: int = 1):
    """RMSNorm(h) = h * rsqrt(mean(h^2) + eps) * scale in fp32, cast to out_dtype. passes=True returns (h, y, ...):
    the residual stream goes on through the first output, whose gradient the backward kernel adds; y comes
    `outputs` times, one for each group of its consumers, whose gradients the kernel then sums itself."""
    E = h_BxTxE.shape[-1]
    h_NxE = h_BxTxE.reshape(-1, E)
    if passes:
        outs = _norm_passing(h_NxE, scale_E, float(eps), jnp.dtype(out_dtype), outputs)
        return tuple(o.reshape(h_BxTxE.shape) for o in outs)
    return _norm(h_NxE, scale_E, float(eps), jnp.dtype(out_dtype)).reshape(h_BxTxE.shape)
