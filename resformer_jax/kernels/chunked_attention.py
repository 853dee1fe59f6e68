"""Causal attention in query blocks, each against only its key prefix.

Plain XLA ops, no custom kernel: the queries are cut into static blocks and
block i attends to keys [0, end_i), so the masked upper triangle of the
attention matrix is never computed (about half the work at n blocks:
(n+1)/(2n)). The softmax is normalised after the A·V product, on the
[.., T, D] output rather than the [.., T, S] probabilities, which saves one
pass over the largest tensor.

Why it exists: on CPU the step is bound by memory traffic over the
[B, H, T, S] logits, not by FLOPs (jax.nn.dot_product_attention's xla path
materialises and masks all of it). Measured on the 2-core CPU at the 82M
shapes (B=8, T=512, H=8, D=64), forward+backward of one layer: 548 ms with
`xla`, ~190 ms with this.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MIN_BLOCK = 128
MAX_BLOCKS = 16  # bounds the unrolled HLO (and compile time) at long context


def block_size(T: int) -> int:
    return max(MIN_BLOCK, -(-T // MAX_BLOCKS))


def chunked_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, *, causal=True, block=None):
    """Same contract as kernels.attention: q [B, T, H, D], k/v [B, S, K, D], K | H.

    Query t sits at position S - T + t (aligned at the end, as in decode).
    """
    B, T, H, D = q_BxTxHxD.shape
    S, K = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
    G = H // K
    dtype = q_BxTxHxD.dtype
    scale = 1.0 / math.sqrt(D)
    # [B, K, G, T, D] queries and [B, K, S, D] keys/values: GQA without repeating K/V.
    q_BxKxGxTxD = (q_BxTxHxD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)).astype(jnp.float32) * scale
    k_BxKxSxD = k_BxSxKxD.transpose(0, 2, 1, 3).astype(jnp.float32)
    v_BxKxSxD = v_BxSxKxD.transpose(0, 2, 1, 3).astype(jnp.float32)
    C = block or (block_size(T) if causal else T)
    offset = S - T
    outs = []
    for start in range(0, T, C):
        stop = min(start + C, T)
        S_i = stop + offset if causal else S  # the key prefix this block can see
        q_i = q_BxKxGxTxD[:, :, :, start:stop]
        logits_BxKxGxCxS = jnp.einsum("bkgtd,bksd->bkgts", q_i, k_BxKxSxD[:, :, :S_i])
        if causal:
            q_pos_C = jnp.arange(start, stop) + offset
            visible_CxS = jnp.arange(S_i)[None, :] <= q_pos_C[:, None]
            logits_BxKxGxCxS = jnp.where(visible_CxS, logits_BxKxGxCxS, -1e30)
        # Softmax with the division deferred to the output (rows of A sum to one).
        row_max = jax.lax.stop_gradient(logits_BxKxGxCxS.max(axis=-1, keepdims=True))
        e_BxKxGxCxS = jnp.exp(logits_BxKxGxCxS - row_max)
        u_BxKxGxCxD = jnp.einsum("bkgts,bksd->bkgtd", e_BxKxGxCxS, v_BxKxSxD[:, :, :S_i])
        outs.append(u_BxKxGxCxD / e_BxKxGxCxS.sum(axis=-1, keepdims=True))
    out_BxKxGxTxD = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
    return out_BxKxGxTxD.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(dtype)
