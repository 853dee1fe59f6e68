"""Causal attention in query blocks, each against only its key prefix.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from resformer_jax.kernels.names import target_backend

MIN_BLOCK = 128
MAX_BLOCKS = 16
# CPU: the logits a (batch, kv-head) group of one query block may hold: about one core's L2 (the sizes tried are in
# docs/performance.md).
CACHE_BYTES = 512 * 1024


def block_size(T: int) -> int:
    return max(MIN_BLOCK, -(-T // MAX_BLOCKS))


def pairs_per_step(G, C, S, itemsize=4) -> int:
    """How many (batch, kv-head) pairs keep a [G, C, S] logits block each within CACHE_BYTES (at least 1)."""
    return max(1, CACHE_BYTES // (G * C * S * itemsize))


def chunked_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, *, causal=True, block=None, pairs=None, segments_BxT=None):
    """Same contract as kernels/attention.attention: q [B, T, H, D], k/v [B, S, K, D], K | H; `segments_BxT` (T == S):
    packed documents, each query masked to its own.

    Query t sits at position S - T + t (aligned at the end, as in decode). `pairs`: (batch, kv-head) pairs
    per loop step; None: on a CPU as many as fit CACHE_BYTES (docs/modules.md), elsewhere 0 = all at once.
    """
    B, T, H, D = q_BxTxHxD.shape
    S, K = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
    G = H // K
    dtype = q_BxTxHxD.dtype
    # [B, K, G, T, D] queries and [B, K, S, D] keys/values: GQA without repeating K/V.
    # Matmul operands stay in the compute dtype (fp32, or bf16 with fp32 accumulation: XLA:CPU's and every
    # accelerator's fast path); the softmax and its statistics are fp32.
    q_BxKxGxTxD = q_BxTxHxD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
    q_BxKxGxTxD = (q_BxKxGxTxD.astype(jnp.float32) * (1.0 / math.sqrt(D))).astype(dtype)
    k_BxKxSxD = k_BxSxKxD.transpose(0, 2, 1, 3).astype(dtype)
    v_BxKxSxD = v_BxSxKxD.transpose(0, 2, 1, 3).astype(dtype)
    C = block or (block_size(T) if causal else T)
    spans = _spans(T, S, C, causal)
    if pairs is None:  # accelerators keep the batched form (kernels/attention.attention passes 0 under a mesh)
        pairs = pairs_per_step(G, min(C, T), S) if target_backend() == "cpu" else 0
    seg_BxKxS = None  # one sequence: no document mask, not even a zero one
    if segments_BxT is not None:
        seg_BxKxS = jnp.broadcast_to(segments_BxT.astype(jnp.int32)[:, None, :], (B, K, S))
    out_BxKxGxTxD = _attend(q_BxKxGxTxD, k_BxKxSxD, v_BxKxSxD, seg_BxKxS, spans, pairs if pairs < B * K else 0)
    return out_BxKxGxTxD.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(dtype)


def _per_pairs(fn, pairs, *xs_BxKx):
    """fn over [B, K, ...] arrays, `pairs` (batch, kv-head) pairs per loop step (0: all at once); fn's outputs are
    [B, K, ...] too."""
    if not pairs:
        return fn(*xs_BxKx)
    B, K = xs_BxKx[0].shape[:2]
    # Each pair as a [1, 1, ...] batch of its own: lax.map vmaps fn over `pairs` of them per step (None: absent).
    xs = tuple(None if x is None else x.reshape(B * K, 1, 1, *x.shape[2:]) for x in xs_BxKx)
    out = jax.lax.map(lambda a: fn(*a), xs, batch_size=pairs)
    return jax.tree.map(lambda y: y.reshape(B, K, *y.shape[3:]), out)


def _spans(T, S, C, causal):
    """(start, stop, keys, offset) per query block: block [start, stop) sees keys [0, keys);
    offset is where query 0 sits among the keys (None: no causal mask)."""
    offset = S - T
    return tuple(
        (a, min(a + C, T), min(a + C, T) + offset, offset) if causal else (a, min(a + C, T), S, None)
        for a in range(0, T, C)
    )


def _block_logits(q_BxKxGxTxD, k_BxKxSxD, seg_BxKxS, start, stop, keys, causal_offset):
    """The block's scaled logits [B, K, G, C, keys] in fp32, the causal mask applied as an additive [C, keys]
    bias (0 or -1e30): a bias this small is read inside the fusion, where a select against a -1e30 broadcast
    of the block's full shape was hoisted out of the layer loop and materialised (XLA:CPU). Packed documents
    (segment ids) add a [B, K, 1, C, keys] bias of the same kind."""
    logits = jnp.einsum(
        "bkgtd,bksd->bkgts",
        q_BxKxGxTxD[:, :, :, start:stop],
        k_BxKxSxD[:, :, :keys],
        preferred_element_type=jnp.float32,
    )
    if causal_offset is None:
        return logits
    visible_CxS = jnp.arange(keys)[None, :] <= (jnp.arange(start, stop) + causal_offset)[:, None]
    logits = logits + jnp.where(visible_CxS, 0.0, -1e30).astype(jnp.float32)
    if seg_BxKxS is None:
        return logits
    q_seg = seg_BxKxS[:, :, start + causal_offset : stop + causal_offset]
    same_BxKxCxS = q_seg[:, :, :, None] == seg_BxKxS[:, :, None, :keys]
    return logits + jnp.where(same_BxKxCxS, 0.0, -1e30).astype(jnp.float32)[:, :, None]


def _forward(q, k, v, seg, spans):
    """Output and log-sum-exp per query; the softmax is normalised on the [C, D] output."""
    outs, lses = [], []
    for start, stop, keys, offset in spans:
        logits = _block_logits(q, k, seg, start, stop, keys, offset)
        row_max = logits.max(axis=-1, keepdims=True)
        e = jnp.exp(logits - row_max)
        denom = e.sum(axis=-1, keepdims=True)
        outs.append(
            jnp.einsum("bkgts,bksd->bkgtd", e.astype(v.dtype), v[:, :, :keys], preferred_element_type=jnp.float32)
            / denom
        )
        lses.append(row_max + jnp.log(denom))
    cat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=3)
    return cat(outs), cat(lses)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(q, k, v, seg, spans, pairs):
    return _per_pairs(partial(_forward, spans=spans), pairs, q, k, v, seg)[0]


def _attend_fwd(q, k, v, seg, spans, pairs):
    out, lse = _per_pairs(partial(_forward, spans=spans), pairs, q, k, v, seg)
    # Residuals are O(T), not O(T * S): the backward recomputes each block's probabilities
    # from the saved log-sum-exp (FlashAttention-2's recipe). Besides memory, this keeps the
    # residual count of a scanned layer small, which is what XLA:CPU's compile time grows with.
    return out, (q, k, v, seg, out, lse)


def _attend_bwd(spans, pairs, res, g):
    dq, dk, dv = _per_pairs(partial(_backward, spans=spans), pairs, *res, g)
    return dq, dk, dv, None  # the segment ids are integers: no cotangent


def _backward(q, k, v, seg, out, lse, g, spans):
    op, f32 = q.dtype, jnp.float32
    delta = jnp.sum(g.astype(f32) * out.astype(f32), axis=-1, keepdims=True)  # rowsum(dO * O) = rowsum(P * dP)
    g = g.astype(op)
    dqs = []
    dk = jnp.zeros(k.shape, f32)
    dv = jnp.zeros(v.shape, f32)
    for start, stop, keys, offset in spans:
        # masked logits sit at -1e30: exp gives exactly 0 there, no second mask needed
        p = jnp.exp(_block_logits(q, k, seg, start, stop, keys, offset) - lse[:, :, :, start:stop])
        g_i = g[:, :, :, start:stop]
        dv = dv.at[:, :, :keys].add(jnp.einsum("bkgts,bkgtd->bksd", p.astype(op), g_i, preferred_element_type=f32))
        dp = jnp.einsum("bkgtd,bksd->bkgts", g_i, v[:, :, :keys], preferred_element_type=f32)
        ds = (p * (dp - delta[:, :, :, start:stop])).astype(op)
        dqs.append(jnp.einsum("bkgts,bksd->bkgtd", ds, k[:, :, :keys], preferred_element_type=f32))
        dk = dk.at[:, :, :keys].add(
            jnp.einsum("bkgts,bkgtd->bksd", ds, q[:, :, :, start:stop], preferred_element_type=f32)
        )
    dq = dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs, axis=3)
    return dq.astype(op), dk.astype(op), dv.astype(op)


_attend.defvjp(_attend_fwd, _attend_bwd)
