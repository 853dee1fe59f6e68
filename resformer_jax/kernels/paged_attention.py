"""Decode attention over a paged KV cache, reading each row's pages where they lie.

One new token a row attends over the `lengths_B` tokens its pages hold. Pools are laid out as both of JAX's paged
kernels want them, [kv_heads, pages, page_size, D]: on GPU JAX's Pallas `paged_attention` (Triton; interpreted on
other backends, for tests), on TPU JAX's Mosaic `paged_attention` (head_dim a multiple of 128). Elsewhere (CPU, a
TPU at head_dim 64, a cache that is not one pool a layer: SkipV1Former's mixed heads) the pages are gathered into
a contiguous copy and attended with XLA, which moves each cached byte three times (read, write the copy, read it):
`resformer compile --steps=decode` shows it.
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


def kernel_for(impl: str, head_dim: int) -> str | None:
    """Which paged kernel serves a run whose attention_impl is `impl` ('gpu', 'tpu'), None for the gather path.
    JAX's TPU kernel lowers only for head_dim a multiple of 128 (Mosaic's lane width; the 468M's 64 is not). An
    unresolved `auto` (a model built by hand) takes the backend's kernel."""
    if impl == "auto":
        impl = {"gpu": GPU_IMPLS[0], "tpu": TPU_IMPLS[0]}.get(target_backend(), impl)
    if impl in GPU_IMPLS:
        return "gpu"
    if impl in TPU_IMPLS and head_dim % 128 == 0:
        return "tpu"
    return None


def paged_decode_attention(q_BxHxD, k_KxNxPxD, v_KxNxPxD, table_BxP, lengths_B, *, kernel: str):
    """softmax(q k^T / sqrt(D)) v over each row's first lengths_B cached tokens: [B, H, D] in q's dtype."""
    q_BxHxD = (q_BxHxD.astype(jnp.float32) / math.sqrt(q_BxHxD.shape[-1])).astype(q_BxHxD.dtype)
    P = table_BxP.shape[1]
    lengths_B = lengths_B.astype(jnp.int32)
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
