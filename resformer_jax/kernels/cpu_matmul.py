"""XLA:CPU's fast forms of the model's matmuls (config.model.matmuls="cpu", chosen by train/setup on CPU hosts):
bf16 matmuls accumulated in fp32 with canonical operand layouts, and the SwiGLU MLP with its own VJP. The model
calls them through model/layers.dense and swiglu; accelerators take the plain forms there. What each form
gains on CPU is measured in docs/performance.md."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def transposed(x_AxB):
    """x.T as an array of its own on CPU: XLA:CPU folds a plain transpose into the matmul, and its bf16
    matmuls are fast only with both operands row-major and contracting lhs dim 1 with rhs dim 0 (about 3x at
    the LM head's shape). The transpose through a 3-D reshape is not folded. Other backends take x.T (their
    matmuls read either layout)."""
    a, b = x_AxB.shape
    return jax.lax.platform_dependent(
        x_AxB, cpu=lambda x: jnp.transpose(x.reshape(a, b, 1), (1, 0, 2)).reshape(b, a), default=lambda x: x.T
    )


@jax.custom_vjp
def mixed_matmul(x_NxI, w_IxO):
    """x @ w with x in a low-precision compute dtype and w an fp32 parameter: the product of the rounded
    operands accumulated in fp32 (an fp32 [N, O]). The backward multiplies bf16 cotangents, accumulates in
    fp32 and returns w's gradient in fp32 (never rounded to bf16), all with canonical-layout matmuls."""
    return jnp.dot(x_NxI, w_IxO.astype(x_NxI.dtype), preferred_element_type=jnp.float32)


def _mixed_matmul_fwd(x_NxI, w_IxO):
    w_c = w_IxO.astype(x_NxI.dtype)
    return jnp.dot(x_NxI, w_c, preferred_element_type=jnp.float32), (x_NxI, w_c)


def _mixed_matmul_bwd(res, g_NxO):
    x_NxI, w_c = res
    g = g_NxO.astype(x_NxI.dtype)
    dx_NxI = jnp.dot(g, transposed(w_c), preferred_element_type=jnp.float32).astype(x_NxI.dtype)
    dw_IxO = jnp.dot(transposed(x_NxI), g, preferred_element_type=jnp.float32)
    return dx_NxI, dw_IxO


mixed_matmul.defvjp(_mixed_matmul_fwd, _mixed_matmul_bwd)


def rounded_matmul(x_NxI, w_IxO):
    """model.matmuls="rounded", the decode engine's form on a CPU: x in the compute dtype (bf16, fp16), w fp32
    holding the compute dtype's values (engine.serving_params rounds the weights once), multiplied in fp32: the
    same products of the rounded operands, accumulated in fp32, as `mixed_matmul`, equal up to the summation
    order. XLA:CPU's bf16 matrix-vector products read their weights at 1-2 GB/s, its fp32 ones at 20-30
    (docs/evaluation.md)."""
    return jnp.dot(x_NxI.astype(jnp.float32), w_IxO.astype(jnp.float32), preferred_element_type=jnp.float32)


def rounded_swiglu(x_NxE, wg_ExF, wu_ExF, wd_FxE, dtype):
    """The SwiGLU MLP in the "rounded" form: `swiglu_mlp`'s forward (gate, up and the product rounded to the
    compute dtype as there, the activation in fp32) with each matmul a `rounded_matmul`."""
    x = x_NxE.astype(dtype)
    gate_NxF = rounded_matmul(x, wg_ExF).astype(dtype)
    up_NxF = rounded_matmul(x, wu_ExF).astype(dtype)
    h_NxF = (_silu_parts(gate_NxF.astype(jnp.float32))[1] * up_NxF.astype(jnp.float32)).astype(dtype)
    return rounded_matmul(h_NxF, wd_FxE).astype(dtype)


def _silu_parts(g32):
    sig = jax.nn.sigmoid(g32)
    return sig, g32 * sig


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def swiglu_mlp(x_NxE, wg_ExF, wu_ExF, wd_FxE, dtype):
    """The SwiGLU MLP, (silu(x W_gate) * (x W_up)) W_down, with its own VJP. Matmuls take `dtype` operands and
    accumulate in fp32 (bf16: XLA:CPU's fast path); the activation is computed in fp32 and rounded once.

    Why its own VJP: autodiff of the three matmuls and silu saves six [tokens, ffn] tensors per layer (gate, up,
    sigmoid, silu, the product, and the product reshaped for the matmul), and a scanned stack zero-fills and
    copies each of them whole before the loop (JAX initialises a scan's stacked outputs). This saves gate and
    up only and recomputes the product in the backward: one elementwise pass instead of four stacks. The
    backward's matmuls use canonical layouts (`transposed`), weight gradients in fp32. fp32's forward is the
    plain expression, bit for bit."""
    return _swiglu_mlp_fwd(x_NxE, wg_ExF, wu_ExF, wd_FxE, dtype)[0]


def _swiglu_mlp_fwd(x_NxE, wg_ExF, wu_ExF, wd_FxE, dtype):
    x = x_NxE.astype(dtype)
    wg, wu, wd = (w.astype(dtype) for w in (wg_ExF, wu_ExF, wd_FxE))
    gate_NxF = jnp.dot(x, wg, preferred_element_type=jnp.float32).astype(dtype)
    up_NxF = jnp.dot(x, wu, preferred_element_type=jnp.float32).astype(dtype)
    if jnp.dtype(dtype) == jnp.float32:
        h_NxF = jax.nn.silu(gate_NxF) * up_NxF
    else:
        h_NxF = (_silu_parts(gate_NxF.astype(jnp.float32))[1] * up_NxF.astype(jnp.float32)).astype(dtype)
    y_NxE = jnp.dot(h_NxF, wd, preferred_element_type=jnp.float32).astype(dtype)
    return y_NxE, (x, gate_NxF, up_NxF, wg, wu, wd)


def _swiglu_mlp_bwd(dtype, res, dy_NxE):
    x_NxE, gate_NxF, up_NxF, wg, wu, wd = res
    f32 = jnp.float32
    # w^T: fp32 matmuls take it folded (XNNPACK reads either layout); bf16's fast path needs it materialised
    w_t = (lambda w: w.T) if jnp.dtype(dtype) == f32 else transposed
    g, u = gate_NxF.astype(f32), up_NxF.astype(f32)
    sig, silu = _silu_parts(g)
    h_NxF = (silu * u).astype(dtype)
    dy = dy_NxE.astype(dtype)
    # (dy^T h)^T rather than h^T dy: transposing the recomputed h fused its activation into a strided copy;
    # dy^T is 3.5x smaller and the product's transpose is weight-sized.
    dwd_FxE = transposed(jnp.dot(transposed(dy), h_NxF, preferred_element_type=f32))
    dh_NxF = jnp.dot(dy, w_t(wd), preferred_element_type=f32)
    dgate_NxF = (dh_NxF * u * sig * (1 + g * (1 - sig))).astype(dtype)  # d silu(g)/dg = sig (1 + g (1 - sig))
    dup_NxF = (dh_NxF * silu).astype(dtype)
    x_ExN = transposed(x_NxE)
    dwg_ExF = jnp.dot(x_ExN, dgate_NxF, preferred_element_type=f32)
    dwu_ExF = jnp.dot(x_ExN, dup_NxF, preferred_element_type=f32)
    dx_NxE = jnp.dot(dgate_NxF, w_t(wg), preferred_element_type=f32) + jnp.dot(
        dup_NxF, w_t(wu), preferred_element_type=f32
    )
    return dx_NxE.astype(x_NxE.dtype), dwg_ExF, dwu_ExF, dwd_FxE


swiglu_mlp.defvjp(_swiglu_mlp_fwd, _swiglu_mlp_bwd)
