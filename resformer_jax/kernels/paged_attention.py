"""Decode attention over a paged KV cache, reading each row's pages where they lie.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax

from resformer_jax.kernels import cpu_paged_attention
from resformer_jax.kernels.names import target_backend

PAGES_MAJOR = ("lanes", "native")  # kernels whose pools are [pages, page_size, kv_heads * D]
GPU_IMPLS = ("pallas", "cudnn")  # a run on a GPU: JAX's Pallas paged kernel
TPU_IMPLS = ("splash",)  # a run on a TPU: JAX's Mosaic paged kernel


def pool_shape(kernel: str, heads: int, num_pages: int, page_size: int, D: int) -> tuple[int, ...]:
    """The pool of a layer's cache as `kernel` (kernel_for) reads it: heads-major for JAX's paged kernels and XLA's
    loop on a CPU, pages-major with the heads in the minor dimension for the TPU's loop and the native CPU kernel."""
    if kernel in PAGES_MAJOR:
        return (num_pages, page_size, heads * D)
    return (heads, num_pages, page_size, D)


def pages_axis(kernel: str) -> int:
    """The pool's pages axis (what a mesh splits: each device holds its rows' pages)."""
    return 0 if kernel in PAGES_MAJOR else 1


def pool_dtype(kernel: str, dtype) -> jnp.dtype:
    """How a pool that `kernel` reads stores values of `dtype`: bf16 as its bits (uint16) for the CPU's kernels
    (native, XLA's loop): XLA:CPU's scatter converted a bf16 pool whole to fp32 and back at every write (82M, batch
    32 at 2K: 1,246 ms a step; 680 with the bits bitcast at each write, which XLA:CPU copies whole too). Every
    other kernel and dtype as itself."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if dtype == jnp.bfloat16 and kernel in ("native", "blocks") else dtype


def values(x):
    """A pool's (or its gathered pages') values: bf16 from stored bits (pool_dtype), else x itself."""
    return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def write_tokens(pool, page_BxT, offset_BxT, cur_BxTxKxD, kernel: str):
    """The pool with token t of row b written at (page_BxT[b, t], offset_BxT[b, t])."""
    B, T, K, D = cur_BxTxKxD.shape
    if pool.dtype == jnp.uint16:  # bf16 stored as bits
        cur_BxTxKxD = lax.bitcast_convert_type(cur_BxTxKxD.astype(jnp.bfloat16), jnp.uint16)
    else:
        cur_BxTxKxD = cur_BxTxKxD.astype(pool.dtype)
    if kernel in PAGES_MAJOR:
        return pool.at[page_BxT, offset_BxT].set(cur_BxTxKxD.reshape(B, T, K * D))
    return pool.at[:, page_BxT, offset_BxT].set(cur_BxTxKxD.transpose(2, 0, 1, 3))


def gather_pages(pool, table_BxP, kernel: str, heads: int):
    """The rows' pages in order, contiguous: [B, P * page_size, K, D] (position s of a sequence at index s)."""
    B, P = table_BxP.shape
    if kernel in PAGES_MAJOR:
        _, page, E = pool.shape
        return values(pool[table_BxP].reshape(B, P * page, heads, E // heads))
    K, _, page, D = pool.shape
    return values(pool[:, table_BxP].transpose(1, 2, 3, 0, 4).reshape(B, P * page, K, D))


def kernel_for(impl: str, head_dim: int) -> str:
    """Which paged kernel serves a run whose attention_impl is `impl`: 'gpu', 'tpu', 'native' (a CPU's, when it
    builds), or XLA's loop over blocks of pages: 'lanes' on a TPU (pages-major pools), 'blocks' elsewhere. JAX's
    TPU kernel lowers only for head_dim a multiple of 128 (Mosaic's lane width; the 468M's 64 is not). An
    unresolved `auto` (a model built by hand) takes the backend's kernel."""
    if impl == "auto":
        impl = {"gpu": GPU_IMPLS[0], "tpu": TPU_IMPLS[0]}.get(target_backend(), impl)
    if impl in GPU_IMPLS:
        return "gpu"
    if impl in TPU_IMPLS and head_dim % 128 == 0:
        return "tpu"
    if impl in TPU_IMPLS or target_backend() == "tpu":
        return "lanes"
    native = target_backend() == "cpu" and head_dim % 8 == 0  # the native kernel reads D in vectors of 8
    return "native" if native and cpu_paged_attention.available() else "blocks"


def blocked_decode_attention(q_BxHxD, k_pool, v_pool, table_BxP, lengths_B, *, block_bytes: int = 4 << 20):
    """paged_decode_attention with XLA over heads-major pools [K, pages, page_size, D] or pages-major ones [pages,
    page_size, K * D] ('lanes'): a loop over blocks of pages (online softmax in fp32, flash-decoding's recurrence),
    up to the longest row's last filled page. A block's gathered K and V take at most `block_bytes` (measured best
    on a 2-core CPU: 4 MB, at most 8 pages a row; see docs/kernels-and-compile.md). [B, H, D] in q's dtype."""
    lanes = k_pool.ndim == 3
    B, H, D = q_BxHxD.shape
    K, page = (k_pool.shape[2] // D, k_pool.shape[1]) if lanes else (k_pool.shape[0], k_pool.shape[2])
    P = table_BxP.shape[1]
    page_bytes = 2 * B * page * K * D * k_pool.dtype.itemsize  # one page a row, K and V
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
        if lanes:  # a page: one contiguous slice of the pool
            k_blk, v_blk = (values(x[pages_BxR]).reshape(B, S, K, D) for x in (k_pool, v_pool))
            layout = "bskd"
        else:  # the einsums read [K, B, S, D] with no transpose (XLA:CPU's fast layout)
            k_blk, v_blk = (values(x[:, pages_BxR]).reshape(K, B, S, D) for x in (k_pool, v_pool))
            layout = "kbsd"
        s_BxKxGxS = jnp.einsum(f"bkgd,{layout}->bkgs", q_BxKxGxD, k_blk, preferred_element_type=jnp.float32)
        filled_BxS = j * S + jnp.arange(S)[None, :] < lengths_B[:, None]
        s_BxKxGxS = jnp.where(filled_BxS[:, None, None, :], s_BxKxGxS, -jnp.inf)
        m_new = jnp.maximum(m_BxKxG, s_BxKxGxS.max(-1))
        p_BxKxGxS = jnp.exp(s_BxKxGxS - m_new[..., None])
        rescale = jnp.exp(m_BxKxG - m_new)
        l_new = l_BxKxG * rescale + p_BxKxGxS.sum(-1)
        pv = jnp.einsum(f"bkgs,{layout}->bkgd", p_BxKxGxS, v_blk.astype(jnp.float32))
        return m_new, l_new, acc_BxKxGxD * rescale[..., None] + pv

    G = H // K
    init = (jnp.full((B, K, G), -jnp.inf), jnp.zeros((B, K, G)), jnp.zeros((B, K, G, D)))
    # every row holds >= 1 token, so block 0 makes m finite before any fully masked block is met
    used = jnp.minimum(-(-jnp.max(lengths_B) // S), blocks)
    _, l_BxKxG, acc_BxKxGxD = lax.fori_loop(0, used, block, init)
    return (acc_BxKxGxD / l_BxKxG[..., None]).reshape(B, H, D).astype(q_BxHxD.dtype)


def paged_decode_attention(q_BxHxD, k_pool, v_pool, table_BxP, lengths_B, *, kernel: str):
    """softmax(q k^T / sqrt(D)) v over each row's first lengths_B cached tokens, the pools laid out for `kernel`
    (pool_shape): [B, H, D] in q's dtype."""
    lengths_B = lengths_B.astype(jnp.int32)
    if kernel == "native":
        return cpu_paged_attention.paged_decode_attention(q_BxHxD, k_pool, v_pool, table_BxP, lengths_B)
    if kernel in ("blocks", "lanes"):
        return blocked_decode_attention(q_BxHxD, k_pool, v_pool, table_BxP, lengths_B)
    k_KxNxPxD, v_KxNxPxD = k_pool, v_pool
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
    args = (q_BxHxD, k_KxNxPxD, v_KxNxPxD, table_BxP, lengths_B)
    return lax.platform_dependent(*args, cuda=call, default=functools.partial(call, interpret=True))
