"""Next-token cross entropy, with a fused, chunked LM head for training.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from resformer_jax.kernels.cpu_matmul import transposed


class HeadPlan(NamedTuple):
    """How the fused LM head runs (why: docs/modules.md)."""

    vocab_multiple: int = 1  # W's vocabulary axis padded to a multiple of this
    logits_dtype: str | None = "float32"  # what the logits GEMM writes; None: the compute dtype
    one_pass_logsumexp: bool = False  # log Z in one read of the logits (online_logsumexp), not a max then a sum


CPU_HEAD = HeadPlan()  # fp32 logits, no padding
# padded to 128, compute-dtype logits, log Z in one pass
ACCELERATOR_HEAD = HeadPlan(vocab_multiple=128, logits_dtype=None, one_pass_logsumexp=True)


def head_plan(cpu_matmuls: bool) -> HeadPlan:
    """The head for the model's matmul form (model/layers.py uses_cpu_matmuls)."""
    return CPU_HEAD if cpu_matmuls else ACCELERATOR_HEAD


def cross_entropy(logits_BxTxV, targets_BxT):
    """Mean next-token cross entropy in fp32 (a target of -1 counts as 0, as in chunked_lm_loss)."""
    logits = logits_BxTxV.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.maximum(targets_BxT, 0)[..., None], axis=-1)[..., 0]
    return jnp.mean(jnp.where(targets_BxT >= 0, logz - picked, 0.0))


def online_logsumexp(x, axis: int = -1):
    """log sum exp(x) over `axis` in one read of x: a reduction of (running max, sum of exp below it) pairs, as
    FlashAttention's online softmax keeps them (jax.nn.logsumexp reads x twice: its max, then the sum)."""

    def combine(a, b):
        (m1, s1), (m2, s2) = a, b
        m = jnp.maximum(m1, m2)
        # exp(m_i - m) is 1 where m_i is the max (also for two -inf, whose difference would be nan)
        return m, s1 * jnp.exp(jnp.where(m1 == m, 0.0, m1 - m)) + s2 * jnp.exp(jnp.where(m2 == m, 0.0, m2 - m))

    axis = axis % x.ndim
    m, s = jax.lax.reduce(
        (x, jnp.ones_like(x)), (jnp.array(-jnp.inf, x.dtype), jnp.array(0, x.dtype)), combine, (axis,)
    )
    return m + jnp.log(s)


def _blocks(h_BxTxE, targets_BxT, chunk_len):
    """[n, B, C, E] hidden and [n, B, C] targets; padded positions get target -1 (ignored)."""
    B, T, E = h_BxTxE.shape
    n = -(-T // chunk_len)
    pad = n * chunk_len - T
    if pad:
        h_BxTxE = jnp.pad(h_BxTxE, ((0, 0), (0, pad), (0, 0)))
        targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)), constant_values=-1)
    # Blocks along T keep the batch axis (and its sharding) intact.
    h_nxBxCxE = h_BxTxE.reshape(B, n, chunk_len, E).swapaxes(0, 1)
    t_nxBxC = targets_BxT.reshape(B, n, chunk_len).swapaxes(0, 1)
    return h_nxBxCxE, t_nxBxC


def _block_logits(h_BxCxE, w_ExV, plan: HeadPlan):
    # 2-D matmuls throughout: XLA:CPU handles [tokens, E] @ [E, V] best.
    B, C, E = h_BxCxE.shape
    out = jnp.dtype(plan.logits_dtype or h_BxCxE.dtype)
    logits = jnp.dot(h_BxCxE.reshape(B * C, E), w_ExV.astype(h_BxCxE.dtype), preferred_element_type=out)
    return logits.reshape(B, C, -1).astype(jnp.float32)


def _block_loss(h_BxCxE, w_ExV, t_BxC, plan: HeadPlan = CPU_HEAD, vocab: int | None = None):
    """(summed CE over the block's valid positions, fp32 logits, log-partition); columns >= vocab (W's padding) are
    masked to -inf."""
    logits_BxCxV = _block_logits(h_BxCxE, w_ExV, plan)
    if vocab is not None and vocab < logits_BxCxV.shape[-1]:
        logits_BxCxV = jnp.where(jnp.arange(logits_BxCxV.shape[-1]) < vocab, logits_BxCxV, -jnp.inf)
    logz_BxC = online_logsumexp(logits_BxCxV) if plan.one_pass_logsumexp else jax.nn.logsumexp(logits_BxCxV, axis=-1)
    picked_BxC = jnp.take_along_axis(logits_BxCxV, jnp.maximum(t_BxC, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(t_BxC >= 0, logz_BxC - picked_BxC, 0.0)), logits_BxCxV, logz_BxC


def cross_entropy_and_z(logits_BxTxV, targets_BxT):
    """(mean next-token cross entropy, mean log Z^2) in fp32, Z the softmax's normaliser (PaLM's z-loss term)."""
    logits = logits_BxTxV.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.maximum(targets_BxT, 0)[..., None], axis=-1)[..., 0]
    kept = targets_BxT >= 0
    return jnp.mean(jnp.where(kept, logz - picked, 0.0)), jnp.mean(jnp.where(kept, logz**2, 0.0))


def chunked_cross_entropy(h_BxTxE, w_ExV, targets_BxT, chunk_len: int = 128, plan: HeadPlan = CPU_HEAD):
    """mean_t CE(h_t W, target_t), computed `chunk_len` positions at a time."""
    return chunked_lm_loss(h_BxTxE, w_ExV, targets_BxT, chunk_len, 0.0, plan)[0]


def _padded(w_ExV, vocab_multiple: int):
    """W with zero columns up to a multiple of vocab_multiple."""
    V = w_ExV.shape[1]
    pad = -V % max(1, vocab_multiple)
    return jnp.pad(w_ExV, ((0, 0), (0, pad))) if pad else w_ExV


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def chunked_lm_loss(h_BxTxE, w_ExV, targets_BxT, chunk_len: int = 128, z_loss: float = 0.0, plan: HeadPlan = CPU_HEAD):
    """(mean_t CE(h_t W, target_t) + z_loss * mean_t log Z_t^2, mean_t log Z_t^2), computed `chunk_len` positions at
    a time. The second output is for logging: it carries no gradient of its own."""
    h_n, t_n = _blocks(h_BxTxE, targets_BxT, chunk_len)
    vocab, w_ExV = w_ExV.shape[1], _padded(w_ExV, plan.vocab_multiple)

    def body(carry, xs):
        loss_sum, _, logz_BxC = _block_loss(xs[0], w_ExV, xs[1], plan, vocab)
        z_sum = jnp.sum(jnp.where(xs[1] >= 0, logz_BxC**2, 0.0)) if z_loss else 0.0
        return (carry[0] + loss_sum, carry[1] + z_sum), None

    (total, z_total), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)), (h_n, t_n))
    z_mean = z_total / targets_BxT.size
    loss = total / targets_BxT.size
    return (loss + z_loss * z_mean if z_loss else loss), z_mean


def _fwd(h_BxTxE, w_ExV, targets_BxT, chunk_len, z_loss, plan):
    B, T, E = h_BxTxE.shape
    h_n, t_n = _blocks(h_BxTxE, targets_BxT, chunk_len)
    inv_count = 1.0 / targets_BxT.size
    vocab = w_ExV.shape[1]
    w_c = _padded(w_ExV.astype(h_BxTxE.dtype), plan.vocab_multiple)
    # The backward's matmuls in canonical layout (kernels/cpu_matmul.py `transposed`): needed for bf16's fast path;
    # in fp32 only h^T is materialised (the folded transpose sends the weight gradient to Eigen), while w^T stays
    # folded (XNNPACK takes it as is).
    fp32 = jnp.dtype(h_BxTxE.dtype) == jnp.float32
    w_VxE = w_c.T if fp32 else transposed(w_c)

    def body(carry, xs):
        total, z_total, dw_ExV = carry
        h_BxCxE, t_BxC = xs
        loss_sum, logits_BxCxV, logz_BxC = _block_loss(h_BxCxE, w_c, t_BxC, plan, vocab)
        total = total + loss_sum
        valid_BxC = t_BxC >= 0
        # d(mean CE)/d logits = (softmax - onehot) / count, zero at padded positions.
        vocab_V = jnp.arange(logits_BxCxV.shape[-1])
        probs_BxCxV = jnp.exp(logits_BxCxV - logz_BxC[..., None])
        if z_loss:  # d(z mean log Z^2)/d logits = 2 z log Z softmax / count
            z_total = z_total + jnp.sum(jnp.where(valid_BxC, logz_BxC**2, 0.0))
            dlogits_BxCxV = (
                probs_BxCxV * (1.0 + 2.0 * z_loss * logz_BxC[..., None]) - (vocab_V == t_BxC[..., None])
            ) * (valid_BxC[..., None] * inv_count)
        else:
            dlogits_BxCxV = (probs_BxCxV - (vocab_V == t_BxC[..., None])) * (valid_BxC[..., None] * inv_count)
        dlogits_BxCxV = dlogits_BxCxV.astype(h_BxCxE.dtype)
        Bc, C, E = h_BxCxE.shape
        dlogits_NxV = dlogits_BxCxV.reshape(Bc * C, -1)
        h_NxE = h_BxCxE.reshape(Bc * C, E)
        dh_BxCxE = jnp.dot(dlogits_NxV, w_VxE, preferred_element_type=jnp.float32).reshape(Bc, C, E)
        h_ExN = transposed(h_NxE)
        dw_ExV = dw_ExV + jnp.dot(h_ExN, dlogits_NxV, preferred_element_type=jnp.float32)
        return (total, z_total, dw_ExV), dh_BxCxE.astype(h_BxTxE.dtype)

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jnp.zeros(w_c.shape, jnp.float32))
    (total, z_total, dw_ExV), dh_n = jax.lax.scan(body, init, (h_n, t_n))
    dw_ExV = dw_ExV[:, :vocab]
    dh_BxTxE = dh_n.swapaxes(0, 1).reshape(B, -1, E)[:, :T]
    z_mean, loss = z_total * inv_count, total * inv_count  # (the forms the loss had before the z term)
    return (loss + z_loss * z_mean if z_loss else loss, z_mean), (dh_BxTxE, dw_ExV.astype(w_ExV.dtype))


def _bwd(chunk_len, z_loss, plan, res, g):
    dh_BxTxE, dw_ExV = res
    g_loss = g[0]  # the logged z term (second output) carries no gradient
    return (g_loss * dh_BxTxE).astype(dh_BxTxE.dtype), (g_loss * dw_ExV).astype(dw_ExV.dtype), None


chunked_lm_loss.defvjp(_fwd, _bwd)
