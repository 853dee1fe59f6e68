"""Llama-like building blocks: RMSNorm, SwiGLU MLP, RoPE, embeddings.

Every parameter carries logical axis names (embed, vocab, mlp, q_heads,
kv_heads, head_dim, layers) so parallel/ can map them onto a mesh.
"""
from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Dtype = jnp.dtype


def normal_init(std: float, *names: str):
    return nn.with_logical_partitioning(nn.initializers.normal(std), names)


def transposed(x_AxB):
    """x.T as an array of its own on CPU: XLA:CPU folds a plain transpose into the matmul, and its bf16
    matmuls are fast only with both operands row-major and contracting lhs dim 1 with rhs dim 0 (a [1024, 50277]
    x [50277, 512] product: 234 GFLOP/s folded, 757 canonical; fp32 barely differs). The transpose through a
    3-D reshape is not folded. Other backends take x.T (their matmuls read either layout)."""
    a, b = x_AxB.shape
    return jax.lax.platform_dependent(
        x_AxB, cpu=lambda x: jnp.transpose(x.reshape(a, b, 1), (1, 0, 2)).reshape(b, a), default=lambda x: x.T)


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
    # (dy^T h)^T rather than h^T dy: transposing the recomputed h fused its activation into a strided copy
    # (64 ms per 82M layer); dy^T is 3.5x smaller and the product's transpose is weight-sized.
    dwd_FxE = transposed(jnp.dot(transposed(dy), h_NxF, preferred_element_type=f32))
    dh_NxF = jnp.dot(dy, w_t(wd), preferred_element_type=f32)
    dgate_NxF = (dh_NxF * u * sig * (1 + g * (1 - sig))).astype(dtype)  # d silu(g)/dg = sig (1 + g (1 - sig))
    dup_NxF = (dh_NxF * silu).astype(dtype)
    x_ExN = transposed(x_NxE)
    dwg_ExF = jnp.dot(x_ExN, dgate_NxF, preferred_element_type=f32)
    dwu_ExF = jnp.dot(x_ExN, dup_NxF, preferred_element_type=f32)
    dx_NxE = (jnp.dot(dgate_NxF, w_t(wg), preferred_element_type=f32)
              + jnp.dot(dup_NxF, w_t(wu), preferred_element_type=f32))
    return dx_NxE.astype(x_NxE.dtype), dwg_ExF, dwu_ExF, dwd_FxE


swiglu_mlp.defvjp(_swiglu_mlp_fwd, _swiglu_mlp_bwd)


class RMSNorm(nn.Module):
    eps: float = 1e-5
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BxTxE):
        scale_E = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                             (x_BxTxE.shape[-1],), jnp.float32)
        x = x_BxTxE.astype(jnp.float32)  # normalise in fp32 for stability
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * scale_E).astype(self.dtype)


class DenseGeneral(nn.Module):
    """x @ W with W of shape in_shape + out_shape, fp32 param, compute dtype."""
    out_shape: tuple
    axes: tuple  # logical names of W's dims
    in_dims: int = 1
    std: float = 0.02
    dtype: Dtype = jnp.float32
    out_dtype: Dtype | None = None  # e.g. fp32 logits from bf16 inputs
    use_bias: bool = False  # GPT-2 has biases; the Llama-like default has none

    @nn.compact
    def __call__(self, x):
        in_shape = x.shape[-self.in_dims:]
        w = self.param("kernel", normal_init(self.std, *self.axes), in_shape + tuple(self.out_shape), jnp.float32)
        b = None
        if self.use_bias:
            b = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                self.axes[len(self.axes) - len(self.out_shape):]),
                           tuple(self.out_shape), jnp.float32)
        # One 2-D matmul [tokens, in] @ [in, out]: XLA:CPU runs the backward of the
        # equivalent 3-D/4-D dot_general through extra transposes (MLP fwd+bwd at
        # the 82M shapes: 917 ms as 3-D, 595 ms as 2-D). Reshapes merge the batch
        # axis as the major one, so its sharding carries over.
        lead = x.shape[:x.ndim - self.in_dims]
        n_in, n_out = int(np.prod(in_shape)), int(np.prod(self.out_shape))
        x_NxI = x.reshape(-1, n_in).astype(self.dtype)
        if jnp.dtype(self.dtype) == jnp.float32:
            y = jnp.dot(x_NxI, w.reshape(n_in, n_out), preferred_element_type=self.out_dtype)
        else:
            # Accumulate in fp32 and round once: with bf16 inputs XLA:CPU then runs a bf16 matmul (about 2.7x
            # the bf16-output form, which it upcasts to fp32 first); GPUs and TPUs accumulate in fp32 anyway.
            y = mixed_matmul(x_NxI, w.reshape(n_in, n_out)).astype(self.out_dtype or self.dtype)
        y = y.reshape(lead + tuple(self.out_shape))
        return y if b is None else y + b.astype(y.dtype)


class Kernel(nn.Module):
    """A bare weight, fp32, with logical axis names: `Kernel(shape, axes, name="gate")()` is the parameter
    gate/kernel, as DenseGeneral(name="gate") would hold it, for code that multiplies it itself."""
    shape: tuple
    axes: tuple
    std: float = 0.02

    @nn.compact
    def __call__(self):
        return self.param("kernel", normal_init(self.std, *self.axes), tuple(self.shape), jnp.float32)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), one fused function (`swiglu_mlp`) over 2-D [tokens, features] matmuls."""
    ffn_dim: int
    std: float = 0.02
    dtype: Dtype = jnp.float32
    out_std: float | None = None  # the down projection's init std (None: std)

    @nn.compact
    def __call__(self, x_BxTxE):
        E, F = x_BxTxE.shape[-1], self.ffn_dim
        wg_ExF = Kernel((E, F), ("embed", "mlp"), self.std, name="gate")()
        wu_ExF = Kernel((E, F), ("embed", "mlp"), self.std, name="up")()
        wd_FxE = Kernel((F, E), ("mlp", "embed"), self.std if self.out_std is None else self.out_std, name="down")()
        y_NxE = swiglu_mlp(x_BxTxE.reshape(-1, E), wg_ExF, wu_ExF, wd_FxE, jnp.dtype(self.dtype))
        return y_NxE.reshape(x_BxTxE.shape[:-1] + (E,))


class LayerNorm(nn.Module):
    """GPT-2's LayerNorm: (x - mean) / sqrt(var + eps) * scale + bias, in fp32."""
    eps: float = 1e-5
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BxTxE):
        E = x_BxTxE.shape[-1]
        scale_E = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (E,), jnp.float32)
        bias_E = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), (E,), jnp.float32)
        x = x_BxTxE.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return ((x - mean) * jax.lax.rsqrt(var + self.eps) * scale_E + bias_E).astype(self.dtype)


class GeluMLP(nn.Module):
    """GPT-2's MLP: proj(gelu_tanh(fc(x))), with biases."""
    ffn_dim: int
    std: float = 0.02
    dtype: Dtype = jnp.float32
    out_std: float | None = None  # the down projection's init std (None: std)

    @nn.compact
    def __call__(self, x_BxTxE):
        h_BxTxF = DenseGeneral((self.ffn_dim,), ("embed", "mlp"), std=self.std, dtype=self.dtype, use_bias=True,
                               name="up")(x_BxTxE)
        h_BxTxF = jax.nn.gelu(h_BxTxF, approximate=True)
        return DenseGeneral((x_BxTxE.shape[-1],), ("mlp", "embed"), std=self.std if self.out_std is None else
                            self.out_std, dtype=self.dtype, use_bias=True, name="down")(h_BxTxF)


class Embed(nn.Module):
    vocab_size: int
    d_model: int
    std: float = 0.02
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens_BxT):
        table_VxE = self.param("embedding", normal_init(self.std, "vocab", "embed"),
                               (self.vocab_size, self.d_model), jnp.float32)
        return jnp.take(table_VxE, tokens_BxT, axis=0).astype(self.dtype)


def rope_frequencies(head_dim: int, theta: float = 10000.0, rope_type: str = "default", factor: float = 1.0,
                     low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                     original_max_position: int = 8192) -> np.ndarray:
    """RoPE's inverse frequencies [head_dim / 2] (float64): theta^(-2i/d), then, as Hugging Face's rope_utils:
    `linear` divides them by `factor` (positions interpolated); `llama3` (Llama 3.1) divides the low frequencies
    (wavelength above original_max_position / low_freq_factor) by `factor`, keeps the high ones (wavelength below
    original_max_position / high_freq_factor), and interpolates smoothly in between."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rope_type == "default":
        return inv
    if rope_type == "linear":
        return inv / factor
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r}")
    low_wavelen, high_wavelen = original_max_position / low_freq_factor, original_max_position / high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def rope(x_BxTxHxD, positions_BxT, theta: float = 10000.0, inv_freq=None):
    """Rotary position embedding (rotate-half convention, as in Llama/NeoX); `inv_freq` [D/2] replaces the plain
    theta^(-2i/d) frequencies (RoPE scaling, rope_frequencies)."""
    d = x_BxTxHxD.shape[-1]
    if inv_freq is None:
        inv_freq_D2 = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    else:
        inv_freq_D2 = jnp.asarray(inv_freq, jnp.float32)
    angles_BxTxD2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq_D2
    sin = jnp.sin(angles_BxTxD2)[:, :, None, :]
    cos = jnp.cos(angles_BxTxD2)[:, :, None, :]
    x = x_BxTxHxD.astype(jnp.float32)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxHxD.dtype)
