"""Attention on TPU through the kernel JAX ships and Google maintains: splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`), forward and backward, causal block skipping.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from resformer_jax.kernels.names import target_backend
from resformer_jax.kernels.pallas_attention import visited_blocks

log = logging.getLogger(__name__)
TILE = 128


@functools.cache
def _warn_interpreted(backend: str):
    log.warning(
        "attention_impl='splash' on backend %r: running the TPU kernel in Pallas interpret mode "
        "(correct but slow; for tests)",
        backend,
    )


def _block(n: int) -> int:
    """The largest of 512, 256, 128 dividing n (n is a multiple of 128)."""
    return next(b for b in (512, 256, 128) if n % b == 0)


# Matmuls per visited (query block, key block) pair of splash's kernels, keyed by their names in a compiled
# program: forward QK^T and PV; dK/dV recomputes QK^T, then dV, dP and dK; dQ recomputes QK^T, then dP and dQ.
KERNEL_MATMULS = (("splash_mqa_fwd", 2), ("splash_mqa_dkv", 4), ("splash_mqa_dq", 3))


def kernel_flops(name: str, q_shape, k_shape, causal: bool = True) -> float:
    """FLOPs of one call of splash kernel `name` on q [..., G, T, D] and k [..., S, D] (as this file calls it:
    leading dims batch and kv heads, G query heads a kv head), with this file's blocks and splash's causal block
    skipping."""
    N, (G, T, D) = math.prod(q_shape[:-3]), q_shape[-3:]
    S = k_shape[-2]
    bq, bk = _block(T), _block(S)
    return float(N * G * visited_blocks(T, S, bq, bk, causal) * 2 * bq * bk * D * dict(KERNEL_MATMULS)[name])


def _kernel(one: splash_mask.Mask, G: int, interpret: bool, q_seq_shards: int = 1):
    """Splash's MQA kernel for G query heads sharing `one` mask [T, S], its q rows cut into `q_seq_shards` (a
    context axis: each device holds one cut)."""
    # Built per trace, not cached: the kernel holds its mask tables as arrays, which must not leak
    # from one trace into another.
    T, S = one.shape
    bq, bk = _block(T // q_seq_shards), _block(S)
    queries: dict[str, Any] = dict(block_q=bq, block_q_dkv=bq, block_q_dq=bq)
    keys: dict[str, Any] = dict(
        block_kv=bk, block_kv_compute=bk, block_kv_dkv=bk, block_kv_dkv_compute=bk, block_kv_dq=bk
    )
    sizes = splash.BlockSizes(**queries, **keys)
    mask = splash_mask.MultiHeadMask([one] * G)
    return splash.make_splash_mqa(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=q_seq_shards, interpret=interpret
    )


class _CausalAtPositions(splash_mask._ComputableMask):
    """Causal by each query row's position in the sequence (`positions`), not by its row: the rows of a context
    axis's devices in the balanced layout (names.balanced_order), each device's rows one cut of them."""

    def __init__(self, positions, S: int):
        super().__init__((len(positions), S), mask_function=lambda q_ids, kv_ids: q_ids >= kv_ids)
        self.q_sequence = np.asarray(positions, np.int32)

    def __eq__(self, other):
        return (
            isinstance(other, _CausalAtPositions)
            and self.shape == other.shape
            and np.array_equal(self.q_sequence, other.q_sequence)
        )

    def __hash__(self):
        return hash((type(self), self.shape, self.q_sequence.tobytes()))


def _pad(x, axis, to):
    if x.shape[axis] == to:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, to - x.shape[axis])
    return jnp.pad(x, widths)


def _mask(T: int, S: int, causal: bool) -> splash_mask.Mask:
    return splash_mask.CausalMask((T, S)) if causal else splash_mask.FullMask((T, S))


def splash_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, *, causal=True, segments_BxT=None):
    """`segments_BxT`: packed documents, splash's own segment ids (masked inside the blocks its causal mask visits)."""
    B, T, H, D = q_BxTxHxD.shape
    S, K = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
    if H % K:
        raise ValueError(f"{K} kv heads do not divide {H} query heads")
    if causal and T != S:
        raise ValueError(f"causal splash attention needs equal query and key lengths, got T={T}, S={S}")
    if not causal and S % TILE:
        raise ValueError(f"non-causal splash attention needs a key length that is a multiple of {TILE}, got {S}")
    G = H // K
    Tp, Sp = -(-T // TILE) * TILE, -(-S // TILE) * TILE
    q = (q_BxTxHxD * (1.0 / math.sqrt(D))).astype(q_BxTxHxD.dtype)
    q_BxKxGxTxD = _pad(q, 1, Tp).reshape(B, Tp, K, G, D).transpose(0, 2, 3, 1, 4)
    k_BxKxSxD = _pad(k_BxSxKxD, 1, Sp).transpose(0, 2, 1, 3)
    v_BxKxSxD = _pad(v_BxSxKxD, 1, Sp).transpose(0, 2, 1, 3)

    if segments_BxT is not None:
        seg = segments_BxT.astype(jnp.int32)
        segq = jnp.pad(seg, ((0, 0), (0, Tp - T)), constant_values=-1)
        segk = jnp.pad(seg, ((0, 0), (0, Sp - S)), constant_values=-2)

        def run(interpret):
            def per_row(q, k, v, sq, sk):
                kernel = _kernel(_mask(Tp, Sp, causal), G, interpret)
                ids = splash.SegmentIds(q=sq, kv=sk)
                return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q, k, v)

            return lambda q, k, v: jax.vmap(per_row)(q, k, v, segq, segk)

    else:

        def run(interpret):
            return lambda q, k, v: jax.vmap(jax.vmap(_kernel(_mask(Tp, Sp, causal), G, interpret)))(q, k, v)

    backend = target_backend()  # the compile target inside names.compiling_for (compilation/aot.py)
    if backend != "tpu":
        _warn_interpreted(backend)
    o_BxKxGxTxD = lax.platform_dependent(q_BxKxGxTxD, k_BxKxSxD, v_BxKxSxD, tpu=run(False), default=run(True))
    return o_BxKxGxTxD.transpose(0, 3, 1, 2, 4).reshape(B, Tp, H, D)[:, :T]


def splash_attention_context(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, order, mesh, batch_axes, segments_BxT=None):
    """Causal attention under a context axis, on TPU: q arrives split over the `context` axis in the balanced
    order (`order`: names.balanced_order, each device two slices of the sequence), k and v gathered whole in the
    same order. Each device runs splash on its queries against every key put back in the sequence's order, masked
    by the queries' positions; splash's block tables are cut over the axis (q_seq_shards, MaxText's way), so each
    device skips the key blocks its own slices never see. `segments_BxT` (in the same order): packed documents."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    _, T, H, D = q_BxTxHxD.shape
    K = k_BxSxKxD.shape[2]
    if H % K:
        raise ValueError(f"{K} kv heads do not divide {H} query heads")
    G, N = H // K, dict(mesh.shape)["context"]
    Tl = T // N
    Tlp, Sp = -(-Tl // TILE) * TILE, -(-T // TILE) * TILE
    # each device's rows padded to the tile; a padded row sits at position 0 (it sees key 0, never an empty row)
    positions_NxTlp = np.zeros((N, Tlp), np.int32)
    positions_NxTlp[:, :Tl] = np.asarray(order).reshape(N, Tl)
    one = _CausalAtPositions(positions_NxTlp.reshape(-1), Sp)
    compiled, interpreted = _kernel(one, G, False, N), _kernel(one, G, True, N)
    kernel_spec = compiled.manual_sharding_spec(NamedSharding(mesh, P(None, "context")))
    interpreted_def = jax.tree.structure(interpreted)
    in_order = np.argsort(order)  # the keys (in the balanced order) put back in the sequence's
    backend = target_backend()
    if backend != "tpu":
        _warn_interpreted(backend)

    def per_device(kernel, q, k, v, *segments):
        q = (q * (1.0 / math.sqrt(D))).astype(q.dtype)  # splash does not scale the logits
        q_BxKxGxTxD = _pad(q, 1, Tlp).reshape(q.shape[0], Tlp, K, G, D).transpose(0, 2, 3, 1, 4)
        k_BxKxSxD = _pad(k[:, in_order], 1, Sp).transpose(0, 2, 1, 3)
        v_BxKxSxD = _pad(v[:, in_order], 1, Sp).transpose(0, 2, 1, 3)
        kernels = {"tpu": kernel, "default": jax.tree.unflatten(interpreted_def, jax.tree.leaves(kernel))}
        if segments:
            sq = jnp.pad(segments[0].astype(jnp.int32), ((0, 0), (0, Tlp - Tl)), constant_values=-1)
            sk = jnp.pad(segments[1][:, in_order].astype(jnp.int32), ((0, 0), (0, Sp - T)), constant_values=-2)

            def run(kern):
                def per_row(q, k, v, sq, sk):
                    ids = splash.SegmentIds(q=sq, kv=sk)
                    return jax.vmap(lambda q, k, v: kern(q, k, v, segment_ids=ids))(q, k, v)

                return lambda q, k, v: jax.vmap(per_row)(q, k, v, sq, sk)

        else:

            def run(kern):
                return lambda q, k, v: jax.vmap(jax.vmap(kern))(q, k, v)

        o = lax.platform_dependent(
            q_BxKxGxTxD, k_BxKxSxD, v_BxKxSxD, tpu=run(kernels["tpu"]), default=run(kernels["default"])
        )
        return o.transpose(0, 3, 1, 2, 4).reshape(q.shape[0], Tlp, H, D)[:, :Tl]

    split, whole = P(batch_axes, "context"), P(batch_axes)
    args = (q_BxTxHxD, k_BxSxKxD, v_BxSxKxD) + (() if segments_BxT is None else (segments_BxT, segments_BxT))
    specs = (kernel_spec, split, whole, whole, split, whole)[: len(args) + 1]
    return jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=split, check_vma=False)(compiled, *args)
