"""Llama-like building blocks: RMSNorm, SwiGLU MLP, RoPE, embeddings.

Every parameter carries logical axis names (embed, vocab, mlp, q_heads,
kv_heads, head_dim, layers) so parallel/ can map them onto a mesh.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from resformer_jax import kernels
from resformer_jax.kernels import cpu_matmul
from resformer_jax.kernels import rope as kernel_rope

Dtype = jnp.dtype


def normal_init(std: float, *names: str | None):
    return nn.with_logical_partitioning(nn.initializers.normal(std), names)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x_NxI, w_IxO, out_dtype):
    """x @ w with x in the compute dtype and w an fp32 parameter, as accelerators multiply: the GEMM accumulates
    in fp32 and writes `out_dtype` (the compute dtype: no fp32 activation ever reaches memory). The backward's
    dx is written in the compute dtype too; w's gradient accumulates and stays in fp32 (weight-sized)."""
    return jnp.dot(x_NxI, w_IxO.astype(x_NxI.dtype), preferred_element_type=out_dtype)


def _matmul_fwd(x_NxI, w_IxO, out_dtype):
    w_c = w_IxO.astype(x_NxI.dtype)
    return jnp.dot(x_NxI, w_c, preferred_element_type=out_dtype), (x_NxI, w_c)


def _matmul_bwd(out_dtype, res, g_NxO):
    x_NxI, w_c = res
    g = g_NxO.astype(x_NxI.dtype)
    return (
        jnp.dot(g, w_c.T, preferred_element_type=x_NxI.dtype),
        jnp.dot(x_NxI.T, g, preferred_element_type=jnp.float32),
    )


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def plain_swiglu(x_NxE, wg_ExF, wu_ExF, wd_FxE, dtype):
    """down(silu(x W_gate) * (x W_up)): three `matmul`s in the compute dtype, the activation in fp32, autodiff."""
    x = x_NxE.astype(dtype)
    gate_NxF, up_NxF = matmul(x, wg_ExF, dtype), matmul(x, wu_ExF, dtype)
    h_NxF = (jax.nn.silu(gate_NxF.astype(jnp.float32)) * up_NxF.astype(jnp.float32)).astype(dtype)
    return matmul(h_NxF, wd_FxE, dtype)


def uses_cpu_matmuls(matmuls: str) -> bool:
    """Whether the model's matmuls (as resolve.py resolved them) take XLA:CPU's fast path (kernels/cpu_matmul.py)
    rather than the form accelerators run ("plain")."""
    return matmuls == "cpu"


def dense(x_NxI, w_IxO, dtype, out_dtype, matmuls: str):
    """[N, I] @ [I, O] in the compute dtype, accumulated in fp32, returned in out_dtype (default: dtype)."""
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.dot(x_NxI.astype(dtype), w_IxO, preferred_element_type=out_dtype)
    x_NxI = x_NxI.astype(dtype)
    if matmuls == "rounded":
        return cpu_matmul.rounded_matmul(x_NxI, w_IxO).astype(out_dtype or dtype)
    if uses_cpu_matmuls(matmuls):
        return cpu_matmul.mixed_matmul(x_NxI, w_IxO).astype(out_dtype or dtype)
    return matmul(x_NxI, w_IxO, jnp.dtype(out_dtype or dtype))


def swiglu(x_NxE, wg_ExF, wu_ExF, wd_FxE, dtype, matmuls: str):
    if matmuls == "rounded" and jnp.dtype(dtype) != jnp.float32:
        return cpu_matmul.rounded_swiglu(x_NxE, wg_ExF, wu_ExF, wd_FxE, jnp.dtype(dtype))
    if uses_cpu_matmuls(matmuls) or jnp.dtype(dtype) == jnp.float32:
        return cpu_matmul.swiglu_mlp(x_NxE, wg_ExF, wu_ExF, wd_FxE, jnp.dtype(dtype))
    return plain_swiglu(x_NxE, wg_ExF, wu_ExF, wd_FxE, jnp.dtype(dtype))


class RMSNorm(nn.Module):
    eps: float = 1e-5
    dtype: Dtype = jnp.float32
    kernel: bool = False  # the Pallas kernels (ModelConfig.norms_in_kernel): one pass each way
    mesh: Any = None  # kernel: the device mesh they run per shard of

    @nn.compact
    def __call__(self, x_BxTxE, passes: bool = False, outputs: int = 1):
        """RMSNorm(x); passes=True: (x, RMSNorm(x), ...), the residual stream going on through the first, whose
        gradient the kernels' backward adds to the norm's in the same pass, and the norm `outputs` times, one for
        each group of its consumers (the kernel sums their gradients: XLA would in a pass of its own)."""
        scale_E = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (x_BxTxE.shape[-1],), jnp.float32
        )
        if self.kernel:
            return kernels.rms_norm(
                x_BxTxE, scale_E, eps=self.eps, out_dtype=self.dtype, passes=passes, outputs=outputs, mesh=self.mesh
            )
        y = kernels.plain_rms_norm(x_BxTxE, scale_E, self.eps, self.dtype)
        return (x_BxTxE,) + (y,) * outputs if passes else y


class DenseGeneral(nn.Module):
    """x @ W with W of shape in_shape + out_shape, fp32 param, compute dtype."""

    out_shape: tuple
    axes: tuple  # logical names of W's dims
    in_dims: int = 1
    std: float = 0.02
    dtype: Dtype = jnp.float32
    out_dtype: Dtype | None = None  # e.g. fp32 logits from bf16 inputs
    use_bias: bool = False  # GPT-2 has biases; the Llama-like default has none
    matmuls: str = "plain"  # config.model.matmuls as resolved: "cpu" | "plain" | "rounded"

    @nn.compact
    def __call__(self, x):
        in_shape = x.shape[-self.in_dims :]
        w = self.param("kernel", normal_init(self.std, *self.axes), in_shape + tuple(self.out_shape), jnp.float32)
        b = None
        if self.use_bias:
            b = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, self.axes[len(self.axes) - len(self.out_shape) :]),
                tuple(self.out_shape),
                jnp.float32,
            )
        # One 2-D matmul [tokens, in] @ [in, out] (XLA:CPU differentiates 3-D/4-D dot_generals through extra
        # transposes); reshapes merge the batch axis as the major one, so its sharding carries over.
        lead = x.shape[: x.ndim - self.in_dims]
        n_in, n_out = int(np.prod(in_shape)), int(np.prod(self.out_shape))
        y = dense(x.reshape(-1, n_in), w.reshape(n_in, n_out), self.dtype, self.out_dtype, self.matmuls)
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
    """down(silu(gate(x)) * up(x)) over 2-D [tokens, features] matmuls (`swiglu`)."""

    ffn_dim: int
    std: float = 0.02
    dtype: Dtype = jnp.float32
    out_std: float | None = None  # the down projection's init std (None: std)
    matmuls: str = "plain"

    @nn.compact
    def __call__(self, x_BxTxE):
        E, F = x_BxTxE.shape[-1], self.ffn_dim
        wg_ExF = Kernel((E, F), ("embed", "mlp"), self.std, name="gate")()
        wu_ExF = Kernel((E, F), ("embed", "mlp"), self.std, name="up")()
        wd_FxE = Kernel((F, E), ("mlp", "embed"), self.std if self.out_std is None else self.out_std, name="down")()
        y_NxE = swiglu(x_BxTxE.reshape(-1, E), wg_ExF, wu_ExF, wd_FxE, self.dtype, self.matmuls)
        return y_NxE.reshape(x_BxTxE.shape[:-1] + (E,))


class LayerNorm(nn.Module):
    """GPT-2's LayerNorm: (x - mean) / sqrt(var + eps) * scale + bias, in fp32."""

    eps: float = 1e-5
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BxTxE, passes: bool = False, outputs: int = 1):
        """passes=True: (x, LayerNorm(x), ...), as RMSNorm's."""
        E = x_BxTxE.shape[-1]
        scale_E = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (E,), jnp.float32)
        bias_E = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), (E,), jnp.float32)
        x = x_BxTxE.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        y = ((x - mean) * jax.lax.rsqrt(var + self.eps) * scale_E + bias_E).astype(self.dtype)
        return (x_BxTxE,) + (y,) * outputs if passes else y


class GeluMLP(nn.Module):
    """GPT-2's MLP: proj(gelu_tanh(fc(x))), with biases."""

    ffn_dim: int
    std: float = 0.02
    dtype: Dtype = jnp.float32
    out_std: float | None = None  # the down projection's init std (None: std)
    matmuls: str = "plain"

    @nn.compact
    def __call__(self, x_BxTxE):
        h_BxTxF = DenseGeneral(
            (self.ffn_dim,),
            ("embed", "mlp"),
            std=self.std,
            dtype=self.dtype,
            use_bias=True,
            matmuls=self.matmuls,
            name="up",
        )(x_BxTxE)
        h_BxTxF = jax.nn.gelu(h_BxTxF, approximate=True)
        return DenseGeneral(
            (x_BxTxE.shape[-1],),
            ("mlp", "embed"),
            std=self.std if self.out_std is None else self.out_std,
            dtype=self.dtype,
            use_bias=True,
            matmuls=self.matmuls,
            name="down",
        )(h_BxTxF)


class Embed(nn.Module):
    vocab_size: int
    d_model: int
    std: float = 0.02
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens_BxT):
        table_VxE = self.param(
            "embedding", normal_init(self.std, "vocab", "embed"), (self.vocab_size, self.d_model), jnp.float32
        )
        return jnp.take(table_VxE, tokens_BxT, axis=0).astype(self.dtype)


def rope_frequencies(
    head_dim: int,
    theta: float = 10000.0,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> np.ndarray:
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
    inv_freq_D2 = kernel_rope.inverse_frequencies(x_BxTxHxD.shape[-1], theta, inv_freq)
    return kernel_rope.rotate_half(x_BxTxHxD, positions_BxT, inv_freq_D2)
