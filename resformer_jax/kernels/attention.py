"""The attention dispatch: `attention(q, k, v, causal=True, impl="auto", ...)` with q [B, T, H, D] and k, v
[B, S, H_kv, D] (GQA without materialising repeated K/V), run by the chosen impl on the whole batch, on each
device's shard of it (custom-call kernels), or context-parallel; what a call carries beside q, k and v is one
frozen `AttentionCall`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from resformer_jax.kernels import KernelUnavailable, context_size, on_context, scoped
from resformer_jax.kernels.names import (
    CONTEXT_PARALLEL_IMPLS,
    DOCUMENT_MASK_IMPLS,
    IMPLS,
    balanced_order,
    target_backend,
    unprobed_auto,
)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """Everything an attention call carries beside q, k and v (`attention`'s keywords; its docstring says each)."""

    causal: bool = True
    impl: str = "auto"
    mesh: Any = None
    batch_axes: tuple[str, ...] = ("data", "fsdp")
    segments_BxT: Any = None
    value_mix: Any = None
    lambda_grads: bool = True
    rope: Any = None

    @property
    def batch_shards(self) -> int:
        """Devices the batch is split over (1 without a mesh)."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes) if self.mesh is not None else 1


@scoped
def reference_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, *, causal=True, mask_BxTxS=None, return_probs=False):
    """Plain einsum + fp32 softmax. Can return the attention matrix A [B, H, T, S]."""
    B, T, H, D = q_BxTxHxD.shape
    S, K = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
    G = H // K
    q_BxTxKxGxD = q_BxTxHxD.reshape(B, T, K, G, D).astype(jnp.float32)
    logits_BxKxGxTxS = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD.astype(jnp.float32)) / math.sqrt(D)
    if mask_BxTxS is None and causal:
        # Query t sits at position S - T + t (aligned at the end, as in decode).
        mask_BxTxS = (jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + (S - T))[None]
    if mask_BxTxS is not None:
        logits_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], logits_BxKxGxTxS, -1e30)
    probs = jax.nn.softmax(logits_BxKxGxTxS, axis=-1)
    out_BxTxKxGxD = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxD.astype(jnp.float32))
    out = out_BxTxKxGxD.reshape(B, T, H, D).astype(q_BxTxHxD.dtype)
    if return_probs:
        return out, probs.reshape(B, H, T, S)
    return out


def _dpa(q, k, v, causal, implementation, segments_BxT=None):
    mask = None if segments_BxT is None else same_document(segments_BxT, segments_BxT)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation=implementation)


def same_document(q_segments_BxT, k_segments_BxS):
    """[B, T, S]: whether query t and key s lie in the same document (a packed sequence's block-diagonal mask)."""
    return q_segments_BxT[:, :, None] == k_segments_BxS[:, None, :]


# Kernels lowered as custom calls (Triton, Mosaic) cannot be partitioned by XLA: under a mesh they run
# per shard of the batch, through shard_map.
CUSTOM_CALL_IMPLS = ("pallas", "splash")


@scoped
def attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, **how):
    """Causal multi-head attention; dispatches to the chosen implementation. `how` is an AttentionCall's fields:

    `causal`, `impl` (names.IMPLS). `segments_BxT`: packed documents (T == S): query t attends to key s only within
    its own document (equal segment ids), block-diagonal causal attention; None: one sequence.

    `value_mix` (impl=pallas only, no context axis): (V_1 [B, S, K, D], (l1, l2) fp32 [2]), with v_BxSxKxD the
    layer's own V_n: attend over ResFormer's l1 V_1 + l2 V_n (Eq. 7), formed by the kernels as they load V;
    lambda_grads=False where (l1, l2) are constants (their gradient then reads as zero). Or (V_1, g fp32
    [B, S, K]): the gated mix g V_1 + (1 - g) V_n of each key row and kv head (its gradient always formed).

    `rope` (impl=pallas only, no context axis): (positions [B, T], inv_freq [D/2]) with q and k before RoPE: the
    kernel rotates them and its dQ and dK/dV kernels rotate their gradients back (kernels/rope.rotate_half).

    `auto` is resolved by the run's setup (`probe_auto`) before the model is built; an
    unresolved `auto` (a model built by hand, shape-only tracing) is `unprobed_auto`: the backend's first
    candidate, what the setup also takes where it cannot probe (compiling for other hardware). With a `mesh` of
    several devices, the custom-call kernels run on each device's shard of the batch (split over `batch_axes`;
    heads and sequence stay whole).
    """
    call = AttentionCall(**how)
    if call.impl == "auto":
        call = dataclasses.replace(call, impl=unprobed_auto(target_backend()))
    impl, context = call.impl, context_size(call.mesh)
    for what, given in (("the value mix", call.value_mix), ("RoPE", call.rope)):
        if given is not None and (impl != "pallas" or context > 1):
            raise ValueError(
                f"{what} is formed inside the attention only by impl='pallas' off a context axis, not {impl!r}"
            )
    if context > 1 and q_BxTxHxD.shape[0] % call.batch_shards == 0:
        return _context_parallel(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, call)
    if call.segments_BxT is not None and impl not in DOCUMENT_MASK_IMPLS:
        raise KernelUnavailable(
            f"attention_impl={impl!r} cannot mask documents (data.document_mask=True); use one of "
            f"{', '.join(DOCUMENT_MASK_IMPLS)}, or auto"
        )
    # A batch that does not divide (model.init traces batch 1) runs whole; train and eval batches
    # always divide (parallel/mesh.check_divisibility).
    if impl in CUSTOM_CALL_IMPLS and call.batch_shards > 1 and q_BxTxHxD.shape[0] % call.batch_shards == 0:
        return _per_batch_shard(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, call)
    return _attention_here(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, call)


def _per_batch_shard(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, call: AttentionCall):
    """A custom-call kernel (XLA cannot partition it) run on each device's shard of the batch."""
    spec = jax.sharding.PartitionSpec(call.batch_axes)

    def per_shard(q, k, v, segments, value_mix, rope):
        here = dataclasses.replace(call, mesh=None, segments_BxT=segments, value_mix=value_mix, rope=rope)
        return _attention_here(q, k, v, here)

    # V_1 split as V; (l1, l2) whole, or a gate [B, S, K] split as V
    mix = call.value_mix
    mix_spec = None if mix is None else (spec, P() if mix[1].ndim == 1 else spec)
    rope_spec = None if call.rope is None else (spec, P())  # positions split as q, inv_freq whole
    specs = (spec, spec, spec, None if call.segments_BxT is None else spec, mix_spec, rope_spec)
    per_device = jax.shard_map(per_shard, mesh=call.mesh, in_specs=specs, out_specs=spec, check_vma=False)
    return per_device(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, call.segments_BxT, mix, call.rope)


def _attention_here(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, call: AttentionCall):
    """The impl itself, on what this program holds (a whole batch, or one shard's under shard_map)."""
    impl, causal, segments_BxT = call.impl, call.causal, call.segments_BxT
    if impl == "reference":
        mask = None
        if segments_BxT is not None:
            T = q_BxTxHxD.shape[1]
            mask = same_document(segments_BxT, segments_BxT) & (jnp.arange(T)[None, :] <= jnp.arange(T)[:, None])
        return reference_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal=causal, mask_BxTxS=mask)
    if impl == "chunked":
        from resformer_jax.kernels.chunked_attention import chunked_attention

        # a loop over (batch, head) pairs on CPU, unless the batch is sharded over a mesh (chunked_attention.py)
        pairs = 0 if call.mesh is not None and call.mesh.size > 1 else None
        return chunked_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal=causal, pairs=pairs, segments_BxT=segments_BxT)
    if impl == "xla":
        return _dpa(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal, "xla", segments_BxT)
    if impl == "cudnn":
        if jax.default_backend() != "gpu":
            # also when compiling for a GPU from a CPU (compilation/aot.py): cuDNN's attention asks the local CUDA
            # runtime for the cuDNN version while tracing, so it cannot even be lowered without a GPU
            raise KernelUnavailable(
                "attention_impl='cudnn' needs an NVIDIA GPU; this backend is "
                f"{jax.default_backend()!r}. Use attention_impl='xla' or 'auto'."
            )
        return _dpa(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal, "cudnn")
    if impl == "pallas":
        from resformer_jax.kernels import pallas_attention

        # what the kernel forms as it loads
        fused = dict(value_mix=call.value_mix, lambda_grads=call.lambda_grads, rope=call.rope)
        return pallas_attention.flash_attention(
            q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal=causal, segments_BxT=segments_BxT, **fused
        )
    if impl == "splash":
        from resformer_jax.kernels import tpu_attention

        return tpu_attention.splash_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal=causal, segments_BxT=segments_BxT)
    raise KernelUnavailable(f"unknown attention impl {impl!r}; use one of {', '.join(IMPLS)}")


def _context_parallel(q, k, v, call: AttentionCall):
    """Context parallelism: the sequence arrives in the balanced order (names.balanced_order: device r holds
    slices r and 2N - 1 - r of it); each device keeps its queries and gathers every key and value over the
    `context` axis (one all-gather of K and one of V a layer; SVFormer's V_1 arrives gathered once, from the
    model). A query attends by its position in the sequence, never by where the layout put it.

    xla, reference: the whole sequence's attention with the mask by position, partitioned by XLA (each device
    computes its T/N x T scores). pallas: the kernel on each device's queries at their positions against the keys
    put back in order (flash_attention_at), key blocks past a query block skipped. splash: the same on TPU, its
    block tables by the queries' positions and cut over the axis (tpu_attention.splash_attention_context)."""
    impl, mesh, batch_axes, segments_BxT = call.impl, call.mesh, call.batch_axes, call.segments_BxT
    if impl not in CONTEXT_PARALLEL_IMPLS:
        raise KernelUnavailable(
            f"attention_impl={impl!r} does not run context-parallel (mesh.context={context_size(mesh)}) yet; "
            f"use one of {', '.join(CONTEXT_PARALLEL_IMPLS)} or auto, or mesh.context=1"
        )
    if not call.causal:
        raise ValueError("context parallelism is for causal attention")
    T, N = q.shape[1], context_size(mesh)
    order = balanced_order(T, N)
    q = on_context(q, mesh, batch_axes)
    k, v = on_context(k, mesh, batch_axes, split=False), on_context(v, mesh, batch_axes, split=False)
    if impl == "splash":
        from resformer_jax.kernels import tpu_attention

        out = tpu_attention.splash_attention_context(q, k, v, order, mesh, batch_axes, segments_BxT)
        return on_context(out, mesh, batch_axes)
    if impl == "pallas":
        from resformer_jax.kernels import pallas_attention

        in_order = np.argsort(order)  # the keys (in the balanced order) put back in the sequence's

        def per_device(q, k, v, *segments):
            r = jax.lax.axis_index("context")
            mine = jax.lax.dynamic_slice_in_dim(jnp.asarray(order, jnp.int32), r * (T // N), T // N)
            positions = jnp.broadcast_to(mine[None], q.shape[:2])
            seg = segments[0][:, in_order] if segments else None
            return pallas_attention.flash_attention_at(q, k[:, in_order], v[:, in_order], positions, segments_BxS=seg)

        split, whole = P(batch_axes, "context"), P(batch_axes)
        args = (q, k, v) + (() if segments_BxT is None else (segments_BxT,))
        specs = (split, whole, whole, whole)[: len(args)]
        out = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=split, check_vma=False)(*args)
        return on_context(out, mesh, batch_axes)
    idx = jnp.asarray(order, jnp.int32)
    mask = (idx[None, :] <= idx[:, None])[None]  # [1, T, S]: key s at or before query t in the sequence
    if segments_BxT is not None:
        mask = mask & same_document(segments_BxT, segments_BxT)
    if impl == "reference":
        out = reference_attention(q, k, v, causal=False, mask_BxTxS=mask)
    else:
        out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")
    return on_context(out, mesh, batch_axes)
