"""RoPE's rotation (rotate-half convention, as in Llama/NeoX), the one formula the model and the attention kernels
share: the Pallas kernel rotates its queries with it and rotates their gradient back in its dQ kernel."""

from __future__ import annotations

import jax.numpy as jnp


def inverse_frequencies(head_dim: int, theta: float = 10000.0, inv_freq=None):
    """[D/2] fp32: theta^(-2i/d), or `inv_freq` where given (RoPE scaling, model/layers.rope_frequencies)."""
    if inv_freq is None:
        return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    return jnp.asarray(inv_freq, jnp.float32)


def rotate_half(x_BxTxHxD, positions_BxT, inv_freq_D2):
    """x rotated by its positions' angles: (x1 cos - x2 sin, x2 cos + x1 sin) over the head's halves, in fp32."""
    d = x_BxTxHxD.shape[-1]
    angles_BxTxD2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq_D2
    sin = jnp.sin(angles_BxTxD2)[:, :, None, :]
    cos = jnp.cos(angles_BxTxD2)[:, :, None, :]
    x = x_BxTxHxD.astype(jnp.float32)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxHxD.dtype)
