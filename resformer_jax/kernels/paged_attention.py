"""Decode attention over a paged KV cache, reading each row's pages where they lie.

One new token a row attends over the `lengths_B` tokens its pages hold. Pools are laid out as both of JAX's paged
kernels want them, [kv_heads, pages, page_size, D]: on GPU JAX's Pallas `paged_attention` (Triton; interpreted on
other backends, for tests), on TPU JAX's Mosaic `paged_attention` (head_dim a multiple of 128). Elsewhere (CPU, a
TPU at head_dim 64) a loop over blocks of pages with an online softmax (`blocked_decode_attention`): each block's
gathered copy is small enough to stay in the processor's cache, so memory is read about once, and the loop stops
at the longest row's last filled page. A cache that is not one pool a layer (SkipV1Former's mixed heads) is
gathered whole into a contiguous copy and attended with XLA, which moves each cached byte three times.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax

from resformer_jax.kernels.names import target_backend

GPU_IMPLS = ("pallas", "cudnn")  # a run on a GPU: JAX's Pallas paged kernel
TPU_IMPLS = ("splash",)  # a run on a TPU: JAX's Mosaic paged kernel


def gather_pages(pool_KxNxPxD, table_BxP):
    """The rows' pages in order, contiguous: [B, P * page_size, K, D] (position s of a sequence at index s)."""
    K, _, page, D = pool_KxNxPxD.shape
    B, P = table_BxP.shape
    return pool_KxNxPxD[:, table_BxP].transpose(1, 2, 3, 0, 4).reshape(B, P * page, K, D)


def kernel_for(impl: str, head_dim: int) -> str:
    """Which paged kernel serves a run whose attention_impl is `impl`: 'gpu', 'tpu', or 'blocks' (XLA's loop over
    blocks of pages). JAX's TPU kernel lowers only for head_dim a multiple of 128 (Mosaic's lane width; the 468M's
    64 is not). An unresolved `auto` (a model built by hand) takes the backend's kernel."""
    if impl == "auto":
        impl = {"gpu": GPU_IMPLS[0], "tpu": TPU_IMPLS[0]}.get(target_backend(), impl)
    if impl in GPU_IMPLS:
        return "gpu"
    if impl in TPU_IMPLS and head_dim % 128 == 0:
        return "tpu"
    return "blocks"


def blocked_decode_attention(q_BxHxD, k_KxNxPxD, v_KxNxPxD, table_BxP, lengths_B, *, block_bytes: int = 4 << 20):
    """paged_decode_attention with XLA: a loop over blocks of pages (online softmax in fp32, flash-decoding's
    recurrence), up to the longest row's last filled page. A block's gathered K and V take at most `block_bytes`
    (measured best on a 2-core CPU: 4 MB, at most 8 pages a row; see docs/kernels-and-compile.md). [B, H, D] in
    q's dtype."""
    K, _, page, D = k_KxNxPxD.shape
    B, H, _ = q_BxHxD.shape
    P = table_BxP.shape[1]
    page_bytes = 2 * B * K * page * D * k_KxNxPxD.dtype.itemsize  # one page a row, K and V
    ppb = 1
    while ppb < min(8, P) and 2 * ppb * page_bytes <= block_bytes:
        ppb *= 2
    blocks = -(-P // ppb)
    table_BxP = jnp.pad(table_BxP, ((0, 0), (0, blocks * ppb - P)))  # padded pages are masked by length
    S = ppb * page  # tokens a block
    q_BxKxGxD = q_BxHxD.astype(jnp.float32).reshape(B, K, H // K, D) / math.sqrt(D)

    def block(j, carry):
        m_BxKxG, l_BxKxG, acc_BxKxGxD = carry
        pages_BxR = lax.dynamic_slice_in_dim(table_BxP, j * ppb, ppb, axis=1)
        k_KxBxSxD = k_KxNxPxD[:, pages_BxR].reshape(K, B, S, D)
        v_KxBxSxD = v_KxNxPxD[:, pages_BxR].reshape(K, B, S, D)
        s_BxKxGxS = jnp.einsum("bkgd,kbsd->bkgs", q_BxKxGxD, k_KxBxSxD, preferred_element_type=jnp.float32)
        filled_BxS = j * S + jnp.arange(S)[None, :] < lengths_B[:, None]
        s_BxKxGxS = jnp.where(filled_BxS[:, None, None, :], s_BxKxGxS, -jnp.inf)
        m_new = jnp.maximum(m_BxKxG, s_BxKxGxS.max(-1))
        p_BxKxGxS = jnp.exp(s_BxKxGxS - m_new[..., None])
        rescale = jnp.exp(m_BxKxG - m_new)
        l_new = l_BxKxG * rescale + p_BxKxGxS.sum(-1)
        pv = jnp.einsum("bkgs,kbsd->bkgd", p_BxKxGxS, v_KxBxSxD.astype(jnp.float32))
        return m_new, l_new, acc_BxKxGxD * rescale[..., None] + pv

    G = H // K
    init = (jnp.full((B, K, G), -jnp.inf), jnp.zeros((B, K, G)), jnp.zeros((B, K, G, D)))
    # every row holds >= 1 token, so block 0 makes m finite before any fully masked block is met
    used = jnp.minimum(-(-jnp.max(lengths_B) // S), blocks)
    _, l_BxKxG, acc_BxKxGxD = lax.fori_loop(0, used, block, init)
    return (acc_BxKxGxD / l_BxKxG[..., None]).reshape(B, H, D).astype(q_BxHxD.dtype)


def paged_decode_attention(q_BxHxD, k_KxNxPxD, v_KxNxPxD, table_BxP, lengths_B, *, kernel: str):
    """softmax(q k^T / sqrt(D)) v over each row's first lengths_B cached tokens: [B, H, D] in q's dtype."""
    lengths_B = lengths_B.astype(jnp.int32)
    if kernel == "blocks":
        return blocked_decode_attention(q_BxHxD, k_KxNxPxD, v_KxNxPxD, table_BxP, lengths_B)
    q_BxHxD = (q_BxHxD.astype(jnp.float32) / math.sqrt(q_BxHxD.shape[-1])).astype(q_BxHxD.dtype)
    P = table_BxP.shape[1]
    if kernel == "tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged

        return tpu_paged(q_BxHxD, k_KxNxPxD, v_KxNxPxD, lengths_B, table_BxP, pages_per_compute_block=min(P, 8))
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_paged

    k_splits = min(P, 16)  # both powers of two (the engine buckets pages per row): the split divides P
    call = functools.partial(gpu_paged, block_h=16, pages_per_compute_block=min(8, P // k_splits), k_splits=k_splits)
    if target_backend() == "gpu":
        return call(q_BxHxD, k_KxNxPxD, v_KxNxPxD, table_BxP, lengths_B)
    # another backend (tests): the same kernel interpreted, unless the program runs on a GPU after all
    return lax.platform_dependent(
        q_BxHxD,
        k_KxNxPxD,
        v_KxNxPxD,
        table_BxP,
        lengths_B,
        cuda=call,
        default=functools.partial(call, interpret=True),
    )
