"""Flash attention in Pallas (FlashAttention-2 style) for NVIDIA GPUs, with a custom VJP. q [B, T, H, D],
k/v [B, S, K, D], K dividing H; the Triton kernel where lowered for CUDA, interpreted elsewhere (the tests).

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from resformer_jax.chips import AMPERE_SMEM, chip_of_device
from resformer_jax.kernels.names import ATTENTION_RESIDUALS, target_backend, target_device_kind
from resformer_jax.kernels.rope import rotate_half

log = logging.getLogger(__name__)
MASK = -1e30


@functools.cache
def _warn_interpreted(backend: str):
    log.warning(
        "attention_impl or norm_impl 'pallas' on backend %r: running the GPU kernel in Pallas interpret mode "
        "(correct but slow; for tests)",
        backend,
    )


NUM_STAGES = 2  # Triton software pipelining of the streamed tiles
SMEM_BUDGET_BYTES = AMPERE_SMEM  # A100's opt-in shared memory per block: the budget where the GPU is not known


def smem_budget(device_kind: str) -> int:
    """The shared memory one kernel block may use on `device_kind` (chips.py; SMEM_BUDGET_BYTES where it is not
    listed)."""
    chip = chip_of_device(device_kind)
    return chip.smem_bytes_per_block if chip is not None and chip.smem_bytes_per_block else SMEM_BUDGET_BYTES


def smem_bytes(bq: int, bk: int, D: int, itemsize: int, num_stages: int = NUM_STAGES) -> int:
    """Estimated shared memory of the largest of the three kernels with these blocks.

    forward: Q tile resident, K and V tiles streamed; dK/dV: K and V resident, Q and dO streamed;
    dQ: Q and dO resident, K and V streamed. Each also converts a [bq, bk] probability tile.
    """
    fwd = bq * D + num_stages * 2 * bk * D + bq * bk
    dkdv = 2 * bk * D + num_stages * 2 * bq * D + bq * bk
    dq = 2 * bq * D + num_stages * 2 * bk * D + bq * bk
    return itemsize * max(fwd, dkdv, dq)


def choose_blocks(
    T: int, S: int, D: int, itemsize: int, block_q: int = 128, block_k: int = 128, budget: int = SMEM_BUDGET_BYTES
) -> tuple[int, int]:
    """Power-of-two (block_q, block_k) >= 16 within the caps, halving the larger until they fit `budget` bytes of
    shared memory (smem_budget of the GPU the kernel is compiled for)."""
    bq, bk = _block(T, block_q), _block(S, block_k)
    while smem_bytes(bq, bk, D, itemsize) > budget and max(bq, bk) > 16:
        if bq >= bk:
            bq //= 2
        else:
            bk //= 2
    return bq, bk


# Matmuls per visited (query block, key block) pair: forward QK^T and PV; dK/dV recomputes QK^T, then dV, dP
# and dK; dQ recomputes QK^T, then dP and dQ. Keyed by the kernels' names (pallas_call name=).
KERNEL_MATMULS = (("flash_attention_fwd", 2), ("flash_attention_dkdv", 4), ("flash_attention_dq", 3))


def visited_blocks(Tp: int, Sp: int, bq: int, bk: int, causal: bool = True) -> int:
    """(query block, key block) pairs the kernels compute: all of them, or with causal block skipping those
    on or below the diagonal (the forward's and dQ's n_k; dK/dV's start visits the same pairs)."""
    nq, nk = Tp // bq, Sp // bk
    if not causal:
        return nq * nk
    if Tp < Sp:  # a device's queries under context parallelism (flash_attention_at): two slices, one from each
        # end of the sequence, see half the keys on average; plus a partial block on each slice's diagonal
        return -(-nq * nk // 2) + nq
    return sum(min(nk, ((i + 1) * bq + bk - 1) // bk) for i in range(nq))


def visited_blocks_documents(eot_RxT, Tp: int, bq: int, bk: int, dkdv: bool) -> float:
    """The (query block, key block) pairs the causal kernels compute on packed documents, averaged over the rows
    of `eot_RxT` (1 at each document's last token, T <= Tp): the forward and dQ skip the key blocks before a query
    block's first document, dK/dV the query blocks after a key block's last (document_tables' rule)."""
    eot = np.asarray(eot_RxT, bool)
    R, T = eot.shape
    idx = np.arange(T)
    starts_here = np.concatenate([np.ones((R, 1), bool), eot[:, :-1]], axis=1)
    start = np.maximum.accumulate(np.where(starts_here, idx, 0), axis=1)
    ends_here = eot | (idx == T - 1)
    end = np.minimum.accumulate(np.where(ends_here, idx + 1, T)[:, ::-1], axis=1)[:, ::-1]
    nq, nk = Tp // bq, Tp // bk
    if dkdv:  # key block j: query blocks from its diagonal to the one holding its last document's end
        last_end = np.stack([end[:, min(j * bk + bk, T) - 1] if j * bk < T else np.zeros(R, int) for j in range(nk)])
        stop = np.minimum(nq, -(-last_end // bq))
        first = (np.arange(nk) * bk // bq)[:, None]
        return float(np.maximum(stop - first, 0).sum(axis=0).mean())
    first_start = np.stack([start[:, i * bq] if i * bq < T else np.full(R, Tp) for i in range(nq)])  # [nq, R]
    n_k = np.minimum(nk, ((np.arange(nq) + 1) * bq - 1 + bk) // bk)[:, None]
    return float(np.maximum(n_k - first_start // bk, 0).sum(axis=0).mean())


def kernel_flops(
    name: str,
    q_shape,
    k_shape,
    itemsize: float,
    causal: bool = True,
    device_kind: str = "",
    documents=None,
    tables: bool = False,
    rope: bool = False,
) -> float:
    """FLOPs of one call of kernel `name` on q [B, Tp, H, D] and k [B, Sp, K, D] (padded) on `device_kind`, by
    this file's own block choice and causal skipping: 2 FLOPs a multiply-add. `tables`: the kernel reads
    per-position tables (its name holds TABLES); `rope`: it rotates RoPE's gradient back (ROPE); `documents` (rows
    of 1s at each document's end, [R, T]): the kernels' packed-document skipping at that packing, averaged over the
    rows."""
    B, Tp, H, D = q_shape
    Sp = k_shape[1]
    bq, bk = choose_blocks(Tp, Sp, D, int(itemsize), budget=smem_budget(device_kind))
    if name != "flash_attention_fwd":
        bq, bk = backward_blocks(bq, bk, D, int(itemsize), tables, rope)
    if documents is not None and tables and causal and Tp == Sp:
        pairs = visited_blocks_documents(documents, Tp, bq, bk, dkdv=name == "flash_attention_dkdv")
    else:
        pairs = visited_blocks(Tp, Sp, bq, bk, causal)
    return float(B * H * pairs * 2 * bq * bk * D * dict(KERNEL_MATMULS)[name])


def backward_blocks(
    bq: int, bk: int, D: int, itemsize: int, tables: bool = False, rope: bool = False
) -> tuple[int, int]:
    """The backward kernels' own blocks, within the forward's: each of their tiles of Q, K, V or dO at most 16 KiB
    (128 rows of 64 bf16 values). The backward keeps two fp32 accumulators and several tiles in registers; past
    that ptxas spills (at head_dim 128 with 128 x 128 blocks: 372 bytes a thread in dK/dV). `tables` (the kernels
    reading per-position tables: packed documents, a context axis's positions): key blocks of at most 64, for
    the registers their masks take (with 128: dK/dV spills 360 bytes a thread at the 468M's shape). `rope` (the
    kernels rotating dQ and dK back): key blocks of at most 64 too, for dK's two half accumulators (with 128:
    8 bytes a thread spill)."""
    while bq > 16 and bq * D * itemsize > 128 * 64 * 2:
        bq //= 2
    while bk > 16 and (bk * D * itemsize > 128 * 64 * 2 or ((tables or rope) and bk > 64)):
        bk //= 2
    return bq, bk


TABLES = "_tables"  # the name suffix of the kernels that read per-position tables (documents, positions)
MIXED = "_value_mix"  # the name suffix of the kernels that form Eq. 7's value mix (after TABLES)
ROPE = "_rope"  # the name suffix of the backward kernels that rotate RoPE's gradient back (after MIXED)


def _kernel_name(base: str, tables: bool, mixed: bool, rope: bool = False) -> str:
    """The pallas_call name the roofline and the ptxas report know a kernel by."""
    return base + (TABLES if tables else "") + (MIXED if mixed else "") + (ROPE if rope else "")


def num_warps(bq: int, bk: int) -> int:
    """Warps a kernel runs with: 8 for tiles of 64 x 128 and larger (with 4, a 128 x 128 tile's accumulators and
    probabilities need more than 255 registers a thread and spill: the compile report's ptxas lines show it), 4
    for smaller tiles."""
    return 8 if bq * bk >= 64 * 128 else 4


def gpu_pallas_call(kernel, *, num_warps_: int, **kw):
    """A pallas_call lowered as a Triton kernel for CUDA and run interpreted on any other platform (the norm
    kernels, kernels/pallas_norm.py, are called through it too)."""

    def compiled(*args):
        return pl.pallas_call(
            kernel, compiler_params=plgpu.CompilerParams(num_warps=num_warps_, num_stages=NUM_STAGES), **kw
        )(*args)

    def interpreted(*args):
        return pl.pallas_call(kernel, interpret=True, **kw)(*args)

    def call(*args):
        backend = target_backend()  # the compile target inside names.compiling_for (compilation/aot.py)
        if backend != "gpu":
            _warn_interpreted(backend)  # once per process
        return lax.platform_dependent(*args, cuda=compiled, default=interpreted)

    return call


def _block(n: int, cap: int) -> int:
    """Power-of-two block >= 16 (Triton's minimum), at most cap."""
    return min(cap, max(16, 1 << max(0, (n - 1).bit_length())))


def _pad(x, axis, to):
    pad = to - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _dot_t(a, b):  # a @ b.T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tdot(a, b):  # a.T @ b
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _mixed_value(v1, vn, l1, l2):
    """Eq. 7's value l1 V_1 + l2 V_n of one block of keys, formed as a kernel loads it (in fp32, rounded to V's
    dtype as the model's mix rounds it): ResFormer's mix then costs no pass over memory of its own."""
    return (l1 * v1.astype(jnp.float32) + l2 * vn.astype(jnp.float32)).astype(vn.dtype)


def _value_loader(v_ref, mix_refs, gated: bool = False):
    """rows -> the block of values the kernel attends over: V's rows, or Eq. 7's mix of V_1's and V_n's rows
    (mix_refs: V_1 and the fp32 pair (l1, l2)); gated: the gate g of each key row, l1 = g and l2 = 1 - g
    (resformer_lambdas=gated, model/attention.gated_value)."""
    if not mix_refs:
        return lambda rows: v_ref[rows, :]
    v1_ref, lam_ref = mix_refs
    if gated:

        def load(rows):
            g = lam_ref[rows][:, None]
            return _mixed_value(v1_ref[rows, :], v_ref[rows, :], g, 1.0 - g)

        return load
    l1, l2 = lam_ref[0], lam_ref[1]
    return lambda rows: _mixed_value(v1_ref[rows, :], v_ref[rows, :], l1, l2)


def _gated(mix) -> bool:
    """Whether a value mix (V_1, weights) weighs by a gate per key row and kv head [B, S, K], not (l1, l2) [2]."""
    return mix is not None and mix[1].ndim == 3


# ----------------------------------------------------------------------------- forward


def _split_refs(refs, docs: bool, positions: bool, n_in: int):
    """(the n_in tensor inputs, the document table or None, the query positions or None, the outputs)."""
    ins, rest = refs[:n_in], refs[n_in:]
    table = rest[0] if docs else None
    rest = rest[1:] if docs else rest
    qpos = rest[0] if positions else None
    return ins, table, qpos, rest[1:] if positions else rest


def _scores_kept(q_idx, k_idx, kv_len: int, bk: int, causal: bool, doc_start=None):
    """[bq, bk]: the scores a block keeps, or None for all of them: keys within the sequence (tested only where
    it was padded to the block), at or before the query (causal), at or after the start of the query's document
    (packed documents: under the causal mask, the keys of its own document)."""
    kept = k_idx[None, :] < kv_len if kv_len % bk else None
    for more in (
        q_idx[:, None] >= k_idx[None, :] if causal else None,
        k_idx[None, :] >= doc_start[:, None] if doc_start is not None else None,
    ):
        if more is not None:
            kept = more if kept is None else kept & more
    return kept


def _fwd_kernel(*refs, scale, causal, bq, bk, kv_len, docs, positions=False, mixed=False, gated=False):
    # docs: packed documents, one more input: where each query's document starts. Under the causal mask a key is
    # in its query's document exactly when it is at or after that start (documents are contiguous), so no segment
    # ids are held; key blocks before the block's first document are skipped, not just masked.
    # positions: the query block's positions in the sequence (context parallelism: a device's queries are two
    # slices of it; the keys are the whole sequence in order), for the causal mask and the blocks skipped
    # mixed: two more inputs, V_1 and (l1, l2): the values attended over are Eq. 7's mix, formed block by block
    ins, start_ref, qpos_ref, (o_ref, lse_ref) = _split_refs(refs, docs, positions, 3 + 2 * mixed)
    q_ref, k_ref, v_ref = ins[:3]
    load_v = _value_loader(v_ref, ins[3:], gated)
    i = pl.program_id(0)
    q = q_ref[...]  # [bq, D]
    D = q.shape[-1]
    q_idx = qpos_ref[...] if positions else i * bq + jnp.arange(bq)

    def body(j, carry):
        acc, m, l = carry
        k = k_ref[pl.ds(j * bk, bk), :]
        v = load_v(pl.ds(j * bk, bk))
        s = _dot_t(q, k) * scale  # [bq, bk] fp32
        mask = _scores_kept(q_idx, j * bk + jnp.arange(bk), kv_len, bk, causal, start_ref[...] if docs else None)
        s = s if mask is None else jnp.where(mask, s, MASK)
        m_new = jnp.maximum(m, s.max(axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = corr * l + p.sum(axis=-1)
        acc = corr[:, None] * acc + _dot(p.astype(v.dtype), v)
        return acc, m_new, l_new

    n_k = pl.cdiv(kv_len, bk)
    if causal:  # blocks wholly above the diagonal are never visited
        n_k = jnp.minimum(n_k, lax.div((jnp.max(q_idx) if positions else (i + 1) * bq - 1) + bk, bk))
    first = lax.div(jnp.min(start_ref[...]), bk) if docs else 0
    init = (jnp.zeros((bq, D), jnp.float32), jnp.full((bq,), MASK, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(first, n_k, body, init)
    l = jnp.where(l == 0, 1.0, l)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def document_tables(seg_BxT, Tp: int, Sp: int):
    """Packed documents' per-position tables, padded: (where each query's document starts [B, Tp] (Tp past T: no
    key), one past where each key's document ends [B, Sp] (0 past S)). Segment ids are non-decreasing along a
    sequence."""
    seg = seg_BxT.astype(jnp.int32)
    B, T = seg.shape
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    starts_here = jnp.concatenate([jnp.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    ends_here = jnp.concatenate([seg[:, 1:] != seg[:, :-1], jnp.ones((B, 1), bool)], axis=1)
    start = lax.cummax(jnp.where(starts_here, idx, 0), axis=1)
    end = lax.cummin(jnp.where(ends_here, idx + 1, T), axis=1, reverse=True)

    def pad(x, to, value):
        return jnp.pad(x, ((0, 0), (0, to - T)), constant_values=value)

    return pad(start, Tp, Tp), pad(end, Sp, 0)


def position_tables(qpos_BxT, S: int, Tp: int, Sp: int, bq: int, seg_BxS=None):
    """Context parallelism's tables: a device's queries at positions `qpos_BxT` (ascending) against the whole
    sequence's S keys in order. Returns (the positions padded [B, Tp] (the last one repeated), for each key the
    first query block that sees it [B, Sp] (past the queries: Tp // bq), and with the keys' segment ids
    `seg_BxS` the document tables as document_tables returns them for these queries (where each query's document
    starts, in the sequence; one past a key's document end counted in this device's queries) or None)."""
    qpos = qpos_BxT.astype(jnp.int32)
    B, T = qpos.shape
    keys = jnp.arange(Sp, dtype=jnp.int32)
    first_query = jax.vmap(lambda p: jnp.searchsorted(p, keys, side="left"))(qpos)  # [B, Sp]
    qstart = jnp.where(keys[None] < S, first_query // bq, Tp // bq).astype(jnp.int32)
    qpos_p = jnp.concatenate([qpos, jnp.broadcast_to(qpos[:, -1:], (B, Tp - T))], axis=1)
    if seg_BxS is None:
        return qpos_p, qstart, None
    start_all, end = document_tables(seg_BxS, S, Sp)
    start = jnp.pad(jax.vmap(lambda x, p: x[p])(start_all, qpos), ((0, 0), (0, Tp - T)), constant_values=Sp)
    end_local = jax.vmap(lambda p, e: jnp.searchsorted(p, e, side="left"))(qpos, end).astype(jnp.int32)
    return qpos_p, qstart, (start, end_local)


def _forward(q, k, v, causal, bq, bk, seg=None, qpos=None, mix=None, dim=None):
    """mix: (V_1 [B, S, K, D], (l1, l2) fp32 [2]): attend over Eq. 7's l1 V_1 + l2 v. dim: the heads' width before
    zero columns padded it to a power of two (the scores' scale is 1/sqrt(dim)); None: D."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    Tp, Sp = pl.cdiv(T, bq) * bq, pl.cdiv(S, bk) * bk
    qp, kp, vp = _pad(q, 1, Tp), _pad(k, 1, Sp), _pad(v, 1, Sp)
    docs, positions = seg is not None, qpos is not None
    scale = 1.0 / math.sqrt(dim or D)
    shape_of = dict(scale=scale, causal=causal, bq=bq, bk=bk, kv_len=S, docs=docs, positions=positions)
    kernel = functools.partial(_fwd_kernel, **shape_of, mixed=mix is not None, gated=_gated(mix))
    kv_spec = pl.BlockSpec((None, Sp, None, D), lambda i, b, h: (b, 0, h // G, 0))
    mix_specs, mix_in = _mix_inputs(mix, kv_spec, Sp)
    extra_specs, extra = [], []
    row_q = pl.BlockSpec((None, bq), lambda i, b, h: (b, i))
    if positions:
        qpos_p, _, tables = position_tables(qpos, S, Tp, Sp, bq, seg)
    if docs:
        start, _ = tables if positions else document_tables(seg, Tp, Sp)
        extra_specs, extra = [row_q], [start]
    if positions:
        extra_specs, extra = [*extra_specs, row_q], [*extra, qpos_p]
    q_block = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0))
    o, lse = gpu_pallas_call(
        kernel,
        num_warps_=num_warps(bq, bk),
        grid=(Tp // bq, B, H),
        in_specs=[q_block, kv_spec, kv_spec, *mix_specs, *extra_specs],
        out_specs=[q_block, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, D), q.dtype), jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)],
        name=_kernel_name("flash_attention_fwd", docs or positions, mix is not None),
    )(qp, kp, vp, *mix_in, *extra)
    return o, lse  # padded along T


def _mix_inputs(mix, v_spec, Sp: int):
    """The kernels' extra inputs for Eq. 7's mix (V_1 padded as V, read through V's spec; (l1, l2) whole, or a gate
    [B, S, K] read as V's rows are), or none."""
    if mix is None:
        return [], []
    v1, lam = mix
    if _gated(mix):
        gate_spec = pl.BlockSpec(v_spec.block_shape[:3], lambda *a: v_spec.index_map(*a)[:3])
        return [v_spec, gate_spec], [_pad(v1, 1, Sp), _pad(lam.astype(jnp.float32), 1, Sp)]
    return [v_spec, pl.BlockSpec((2,), lambda *_: (0,))], [_pad(v1, 1, Sp), lam.astype(jnp.float32)]


# ----------------------------------------------------------------------------- backward


def _dkdv_kernel(
    *refs,
    scale,
    causal,
    bq,
    bk,
    kv_len,
    q_blocks,
    docs,
    positions=False,
    mixed=False,
    gated=False,
    lambda_grads=False,
    rope=False,
):
    # docs: where every query's document starts (the forward's mask), and one past where each key of the block's
    # document ends (query blocks after the block's last document are skipped). positions: every query's
    # position, and for each key of the block the first query block that sees it (query blocks before it skipped)
    # mixed: V is Eq. 7's l1 V_1 + l2 V_n (two more inputs); the kernel writes V_n's gradient l2 dV, V_1's l1 dV,
    # and with lambda_grads the key block's share of the lambdas' gradients (the sums of V_1 . dV and V_n . dV)
    n_mix = 2 * mixed + 2 * lambda_grads
    ins, start_ref, qpos_ref, outs = _split_refs(refs, docs, positions, 6 + n_mix + 2 * rope + positions + docs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins[:6]
    mix_refs = ins[6 : 6 + n_mix]
    rope_refs = ins[6 + n_mix : 6 + n_mix + 2 * rope]
    qstart_ref = ins[6 + n_mix + 2 * rope] if positions else None
    end_ref = ins[6 + n_mix + 2 * rope + positions] if docs else None
    j = pl.program_id(0)
    k = k_ref[...]  # [bk, D]
    v = _value_loader(v_ref, mix_refs[:2], gated)(slice(None))
    D = k.shape[-1]
    k_idx = j * bk + jnp.arange(bk)

    def body_halves(i, carry):  # dK by halves of the head, for RoPE's rotation back (rotate-half pairs d, d + D/2)
        dk1, dk2, dv = carry
        rows = pl.ds(i * bq, bq)
        q1, q2 = q_ref[rows, pl.ds(0, D // 2)], q_ref[rows, pl.ds(D // 2, D // 2)]
        do = do_ref[rows, :]
        lse = lse_ref[rows]
        delta = delta_ref[rows]
        q_idx = qpos_ref[rows] if positions else i * bq + jnp.arange(bq)
        s = (_dot_t(q1, k_ref[:, pl.ds(0, D // 2)]) + _dot_t(q2, k_ref[:, pl.ds(D // 2, D // 2)])) * scale
        mask = _scores_kept(q_idx, k_idx, kv_len, bk, causal, start_ref[rows] if docs else None)
        p = jnp.exp(s - lse[:, None])
        p = p if mask is None else jnp.where(mask, p, 0.0)
        dv = dv + _tdot(p.astype(do.dtype), do)
        ds = (p * (_dot_t(do, v) - delta[:, None])).astype(q1.dtype)
        return dk1 + _tdot(ds, q1) * scale, dk2 + _tdot(ds, q2) * scale, dv

    def body(i, carry):
        dk, dv = carry
        q = q_ref[pl.ds(i * bq, bq), :]
        do = do_ref[pl.ds(i * bq, bq), :]
        lse = lse_ref[pl.ds(i * bq, bq)]
        delta = delta_ref[pl.ds(i * bq, bq)]
        q_idx = qpos_ref[pl.ds(i * bq, bq)] if positions else i * bq + jnp.arange(bq)
        s = _dot_t(q, k) * scale
        start = start_ref[pl.ds(i * bq, bq)] if docs else None
        mask = _scores_kept(q_idx, k_idx, kv_len, bk, causal, start)
        p = jnp.exp(s - lse[:, None])  # recomputed from the saved lse
        p = p if mask is None else jnp.where(mask, p, 0.0)
        dv = dv + _tdot(p.astype(do.dtype), do)
        dp = _dot_t(do, v)
        ds = p * (dp - delta[:, None])
        dk = dk + _tdot(ds.astype(q.dtype), q) * scale
        return dk, dv

    start = lax.div(j * bk, bq) if causal else 0  # query blocks wholly before this key block see none of it
    if causal and positions:
        start = jnp.min(qstart_ref[...])
    stop = jnp.minimum(q_blocks, lax.div(jnp.max(end_ref[...]) + bq - 1, bq)) if docs else q_blocks
    if rope:
        half = jnp.zeros((bk, D // 2), jnp.float32)
        dk1, dk2, dv = lax.fori_loop(start, stop, body_halves, (half, half, jnp.zeros((bk, D), jnp.float32)))
        _write_dv(dv, outs[1:], mix_refs, mixed, gated, lambda_grads)  # first: its registers free for sin/cos
        _write_rotated_back(outs[0], dk1, dk2, *rope_refs)
        return
    init = (jnp.zeros((bk, D), jnp.float32), jnp.zeros((bk, D), jnp.float32))
    dk, dv = lax.fori_loop(start, stop, body, init)
    outs[0][...] = dk.astype(outs[0].dtype)
    _write_dv(dv, outs[1:], mix_refs, mixed, gated, lambda_grads)


def _write_dv(dv, outs, mix_refs, mixed: bool, gated: bool, lambda_grads: bool):
    """dK/dV's value gradients: dV, or with a mix V_n's and V_1's (and the weights' shares or the gate's rows)."""
    if not mixed:
        outs[0][...] = dv.astype(outs[0].dtype)
        return
    lam_ref, (dvn_ref, dv1_ref, *dl_refs) = mix_refs[1], outs
    if gated:  # each key row's own weights: g for V_1, 1 - g for V_n; the gate's gradient (V_1 - V_n) . dV a row
        g = lam_ref[...][:, None]
        dvn_ref[...] = ((1.0 - g) * dv).astype(dvn_ref.dtype)
        dv1_ref[...] = (g * dv).astype(dv1_ref.dtype)
        v1_again, vn_again = mix_refs[2:]
        dl_refs[0][...] = jnp.sum((v1_again[...].astype(jnp.float32) - vn_again[...].astype(jnp.float32)) * dv, 1)
        return
    dvn_ref[...] = (lam_ref[1] * dv).astype(dvn_ref.dtype)
    dv1_ref[...] = (lam_ref[0] * dv).astype(dv1_ref.dtype)
    if lambda_grads:  # this key block's share, one number each, from V_1 and V_n read again through refs of
        # their own (the loads before the loop, kept live through it for these, spilled registers)
        v1_again, vn_again = mix_refs[2:]
        dl_refs[0][...] = jnp.sum(v1_again[...].astype(jnp.float32) * dv)
        dl_refs[1][...] = jnp.sum(vn_again[...].astype(jnp.float32) * dv)


def _dq_kernel(*refs, scale, causal, bq, bk, kv_len, docs, positions=False, mixed=False, gated=False, rope=False):
    # as the forward's; it also forms the block's delta_i = sum_d O_id dO_id (FlashAttention-2) from the O and dO
    # it holds, and writes it for the dK/dV kernel after it (no pass over O and dO of its own)
    n_in = 6 + 2 * mixed + 2 * rope
    ins, start_ref, qpos_ref, (dq_ref, delta_ref) = _split_refs(refs, docs, positions, n_in)
    q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref = ins[:6]
    load_v = _value_loader(v_ref, ins[6 : 6 + 2 * mixed], gated)
    i = pl.program_id(0)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = jnp.sum(o_ref[...].astype(jnp.float32) * do.astype(jnp.float32), axis=1)
    delta_ref[...] = delta
    D = q.shape[-1]
    q_idx = qpos_ref[...] if positions else i * bq + jnp.arange(bq)

    def scores(j):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = load_v(pl.ds(j * bk, bk))
        s = _dot_t(q, k) * scale
        mask = _scores_kept(q_idx, j * bk + jnp.arange(bk), kv_len, bk, causal, start_ref[...] if docs else None)
        p = jnp.exp(s - lse[:, None])
        p = p if mask is None else jnp.where(mask, p, 0.0)
        return (p * (_dot_t(do, v) - delta[:, None])).astype(k.dtype)

    def body(j, dq):
        return dq + _dot(scores(j), k_ref[pl.ds(j * bk, bk), :]) * scale

    def body_halves(j, dq):  # dQ by halves of the head, for RoPE's rotation back (rotate-half pairs d, d + D/2)
        ds = scores(j)
        rows = pl.ds(j * bk, bk)
        return (
            dq[0] + _dot(ds, k_ref[rows, pl.ds(0, D // 2)]) * scale,
            dq[1] + _dot(ds, k_ref[rows, pl.ds(D // 2, D // 2)]) * scale,
        )

    n_k = pl.cdiv(kv_len, bk)
    if causal:
        n_k = jnp.minimum(n_k, lax.div((jnp.max(q_idx) if positions else (i + 1) * bq - 1) + bk, bk))
    first = lax.div(jnp.min(start_ref[...]), bk) if docs else 0
    if not rope:
        dq = lax.fori_loop(first, n_k, body, jnp.zeros((bq, D), jnp.float32))
        dq_ref[...] = dq.astype(dq_ref.dtype)
        return
    zeros = jnp.zeros((bq, D // 2), jnp.float32)
    dq1, dq2 = lax.fori_loop(first, n_k, body_halves, (zeros, zeros))
    _write_rotated_back(dq_ref, dq1, dq2, *ins[6 + 2 * mixed :])


def _write_rotated_back(out_ref, g1, g2, pos_ref, inv_freq_ref):
    """Writes the gradient of x before RoPE from the halves (g1, g2) of its gradient after: the transpose of
    x_rot = (x1 cos - x2 sin, x2 cos + x1 sin) at each row's position (kernels/rope.rotate_half's angles)."""
    D2 = g1.shape[-1]
    angles = pos_ref[...].astype(jnp.float32)[:, None] * inv_freq_ref[...][None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    out_ref[:, pl.ds(0, D2)] = (g1 * cos + g2 * sin).astype(out_ref.dtype)
    out_ref[:, pl.ds(D2, D2)] = (g2 * cos - g1 * sin).astype(out_ref.dtype)


def _backward(
    q, k, v, o_p, lse, do, causal, bq, bk, seg=None, qpos=None, mix=None, lambda_grads=False, rope=None, dim=None
):
    """(dQ, dK, dV) or, with Eq. 7's mix (V_1, (l1, l2)), (dQ, dK, dV_n, dV_1, d(l1, l2)) (zeros unless
    lambda_grads)."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    docs, positions = seg is not None, qpos is not None
    bq, bk = backward_blocks(bq, bk, D, jnp.dtype(q.dtype).itemsize, tables=docs or positions, rope=rope is not None)
    Tp, Sp = o_p.shape[1], pl.cdiv(S, bk) * bk
    qp, kp, vp, dop = _pad(q, 1, Tp), _pad(k, 1, Sp), _pad(v, 1, Sp), _pad(do, 1, Tp)
    scale = 1.0 / math.sqrt(dim or D)
    dkdv_extra_specs, dkdv_extra, dq_extra_specs, dq_extra = [], [], [], []
    key_rows = pl.BlockSpec((None, bk), lambda j, b, h: (b, j))
    query_rows = pl.BlockSpec((None, bq), lambda i, b, h: (b, i))
    if positions:
        qpos_p, qstart, tables = position_tables(qpos, S, Tp, Sp, bq, seg)
    dkdv_first_specs, dkdv_first = [], []  # key-block rows the kernel reads as inputs: qstart, then end
    if positions:
        dkdv_first_specs, dkdv_first = [key_rows], [qstart]
    if docs:
        start, end = tables if positions else document_tables(seg, Tp, Sp)
        dkdv_first_specs, dkdv_first = [*dkdv_first_specs, key_rows], [*dkdv_first, end]
        dkdv_extra_specs, dkdv_extra = [pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0))], [start]
        dq_extra_specs, dq_extra = [query_rows], [start]
    if positions:
        dkdv_extra_specs = [*dkdv_extra_specs, pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0))]
        dkdv_extra = [*dkdv_extra, qpos_p]
        dq_extra_specs, dq_extra = [*dq_extra_specs, query_rows], [*dq_extra, qpos_p]
    gated = _gated(mix)  # a gate's gradient is always formed (it is learned)
    mixed, again = mix is not None, mix is not None and (lambda_grads or gated)  # again: V_1, V_n for the shares
    # dQ first: it writes delta, which dK/dV reads
    q_block = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0))
    row_block = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    kv_full = pl.BlockSpec((None, Sp, None, D), lambda i, b, h: (b, 0, h // G, 0))
    dq_mix_specs, mix_in = _mix_inputs(mix, kv_full, Sp)
    rope_specs, rope_in = [], []
    if rope is not None:  # (positions [B, T], inv_freq [D/2]): dQ rotated back to the query before RoPE
        rope_specs = [query_rows, pl.BlockSpec((D // 2,), lambda i, b, h: (0,))]
        rope_in = [_pad(rope[0].astype(jnp.int32), 1, Tp), rope[1].astype(jnp.float32)]
    shared = dict(
        scale=scale, causal=causal, bq=bq, bk=bk, kv_len=S, docs=docs, positions=positions, mixed=mixed, gated=gated
    )
    dq, delta = gpu_pallas_call(
        functools.partial(_dq_kernel, **shared, rope=rope is not None),
        grid=(Tp // bq, B, H),  # in: q, k, v, dO, lse, O, then what the mix, RoPE and the tables add
        in_specs=[q_block, kv_full, kv_full, q_block, row_block, q_block, *dq_mix_specs, *rope_specs, *dq_extra_specs],
        out_specs=[q_block, row_block],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, D), q.dtype), jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)],
        num_warps_=num_warps(bq, bk),
        name=_kernel_name("flash_attention_dq", docs or positions, mixed, rope is not None),
    )(qp, kp, vp, dop, lse, o_p, *mix_in, *rope_in, *dq_extra)
    q_spec_full = pl.BlockSpec((None, Tp, None, D), lambda j, b, h: (b, 0, h, 0))
    row_full = pl.BlockSpec((None, None, Tp), lambda j, b, h: (b, h, 0))
    kv_block = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h // G, 0))
    out_block = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0))
    dkdv_mix_specs = _mix_inputs(mix, kv_block, Sp)[0] + ([kv_block, kv_block] if again else [])
    # per query head; with one query head a kv head (G = 1) nothing is summed after, so the kernel writes
    # the input dtype (the fp32 accumulators rounded once, as the cast after would)
    grad_shape = jax.ShapeDtypeStruct((B, Sp, H, D), k.dtype if G == 1 else jnp.float32)
    key_share = pl.BlockSpec((None, None, None), lambda j, b, h: (b, h, j))  # per key block: V_1 . dV, V_n . dV
    shares = 2 if again else 0
    share_shape = jax.ShapeDtypeStruct((B, H, Sp // bk), jnp.float32)
    if gated:  # per key row and query head: (V_1 - V_n) . dV, the gate's gradient
        key_share = pl.BlockSpec((None, bk, None), lambda j, b, h: (b, j, h))
        shares, share_shape = 1, jax.ShapeDtypeStruct((B, Sp, H), jnp.float32)
    mix_out_specs = [out_block, *[key_share] * shares] if mixed else []
    mix_out_shape = [grad_shape, *[share_shape] * shares] if mixed else []
    dkdv_rope_specs, dkdv_rope_in = [], []
    if rope is not None:  # dK rotated back by the keys' positions (T == S: the queries' positions)
        dkdv_rope_specs = [key_rows, pl.BlockSpec((D // 2,), lambda j, b, h: (0,))]
        dkdv_rope_in = [_pad(rope[0].astype(jnp.int32), 1, Sp), rope[1].astype(jnp.float32)]
    again_in = mix_in[:1] + [vp] if again else []  # V_1 and V_n again, for the shares
    dk_h, dv_h, *mix_grads = gpu_pallas_call(
        functools.partial(_dkdv_kernel, **shared, q_blocks=Tp // bq, lambda_grads=again, rope=rope is not None),
        grid=(Sp // bk, B, H),  # in: q, k, v, dO, lse, delta, then what the mix, RoPE and the tables add
        in_specs=[q_spec_full, kv_block, kv_block, q_spec_full, row_full, row_full, *dkdv_mix_specs, *dkdv_rope_specs]
        + [*dkdv_first_specs, *dkdv_extra_specs],
        out_specs=[out_block, out_block, *mix_out_specs],
        out_shape=[grad_shape, grad_shape, *mix_out_shape],
        num_warps_=num_warps(bq, bk),
        name=_kernel_name("flash_attention_dkdv", docs or positions, mixed, rope is not None),
    )(qp, kp, vp, dop, lse, delta, *mix_in, *again_in, *dkdv_rope_in, *dkdv_first, *dkdv_extra)

    def per_kv_head(g_h, dtype):  # GQA: a kv head's gradient is the sum over the query heads that read it
        return g_h[:, :S].reshape(B, S, K, G, D).sum(axis=3).astype(dtype)

    dk, dv = per_kv_head(dk_h, k.dtype), per_kv_head(dv_h, v.dtype)
    if not mixed:
        return dq[:, :T], dk, dv
    (dv1_h, *key_shares), (v1, lam) = mix_grads, mix
    if gated:  # the gate's gradient per key row and kv head: the sum over the query heads that read it
        dlam = key_shares[0][:, :S].reshape(B, S, K, G).sum(axis=3)
    else:
        dlam = jnp.stack([x.sum() for x in key_shares]) if again else jnp.zeros_like(lam)
    return dq[:, :T], dk, dv, per_kv_head(dv1_h, v1.dtype), dlam


# ----------------------------------------------------------------------------- public


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _flash(q, k, v, seg, mix, rope, causal, bq, bk, lambda_grads, dim=None):
    """seg: packed documents' segment ids; mix: Eq. 7's (V_1, (l1, l2)) or (V_1, gate); rope: (positions [B, T],
    inv_freq [D/2]), q and k then unrotated: rotated here, their gradients rotated back by the dQ and dK/dV kernels.
    Each None where unused. dim: the heads' width before padding (_forward)."""
    return _flash_fwd(q, k, v, seg, mix, rope, causal, bq, bk, lambda_grads, dim)[0]


def _flash_fwd(q, k, v, seg, mix, rope, causal, bq, bk, lambda_grads, dim=None):
    T = q.shape[1]
    if rope is not None:  # T == S: the keys' positions are the queries'
        q, k = rotate_half(q, *rope), rotate_half(k, *rope)
    o_p, lse = _forward(q, k, v, causal, bq, bk, seg, mix=mix, dim=dim)
    # Named for remat=attention (model/transformer.py): what the backward reads, kept instead of recomputed.
    q, k, v, o_p, lse = (checkpoint_name(x, ATTENTION_RESIDUALS) for x in (q, k, v, o_p, lse))
    if mix is not None:
        mix = (checkpoint_name(mix[0], ATTENTION_RESIDUALS), mix[1])
    return o_p[:, :T], (q, k, v, seg, mix, rope, o_p, lse)


def _flash_bwd(causal, bq, bk, lambda_grads, dim, res, do):
    q, k, v, seg, mix, rope, o_p, lse = res
    grads = _backward(
        q, k, v, o_p, lse, do, causal, bq, bk, seg, mix=mix, lambda_grads=lambda_grads, rope=rope, dim=dim
    )
    dmix = None if mix is None else (grads[3], grads[4])
    return (*grads[:3], None, dmix, None)  # segment ids and positions: integers; inv_freq: a constant


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash_positions(q, k, v, qpos, seg, causal, bq, bk):
    o, _ = _forward(q, k, v, causal, bq, bk, seg, qpos)
    return o[:, : q.shape[1]]


def _flash_positions_fwd(q, k, v, qpos, seg, causal, bq, bk):
    o_p, lse = _forward(q, k, v, causal, bq, bk, seg, qpos)
    q, k, v, o_p, lse = (checkpoint_name(x, ATTENTION_RESIDUALS) for x in (q, k, v, o_p, lse))
    return o_p[:, : q.shape[1]], (q, k, v, qpos, seg, o_p, lse)


def _flash_positions_bwd(causal, bq, bk, res, do):
    q, k, v, qpos, seg, o_p, lse = res
    return (*_backward(q, k, v, o_p, lse, do, causal, bq, bk, seg, qpos), None, None)  # positions, segments


_flash_positions.defvjp(_flash_positions_fwd, _flash_positions_bwd)


def flash_attention_at(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, positions_BxT, *, segments_BxS=None, block_q=128, block_k=128):
    """Causal attention of queries at sequence positions `positions_BxT` (ascending: a device's slices of the
    sequence under context parallelism) over the whole sequence's keys and values [B, S, K, D], in order: query t
    attends key s for s <= positions[t] (and, with the keys' segment ids `segments_BxS`, within its document).
    Key blocks past a query block's last position, and query blocks before a key block's first reader, are
    skipped."""
    _B, T, H, D = q_BxTxHxD.shape
    S, K = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
    if H % K:
        raise ValueError(f"{K} kv heads do not divide {H} query heads")
    bq, bk = choose_blocks(
        T, S, D, jnp.dtype(q_BxTxHxD.dtype).itemsize, block_q, block_k, budget=smem_budget(target_device_kind())
    )
    return _flash_positions(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, positions_BxT, segments_BxS, True, bq, bk)


def flash_attention(
    q_BxTxHxD,
    k_BxSxKxD,
    v_BxSxKxD,
    *,
    causal=True,
    block_q=128,
    block_k=128,
    segments_BxT=None,
    value_mix=None,
    lambda_grads=True,
    rope=None,
):
    """Causal (or full) attention with q [B, T, H, D], k/v [B, S, K, D]; blocks capped at block_q/block_k
    and shrunk to the shared-memory budget (choose_blocks). `segments_BxT` (causal): packed documents, each
    query attending within its own; blocks outside a block's documents are skipped. `value_mix` (V_1
    [B, S, K, D], (l1, l2) fp32 [2]): attend over Eq. 7's l1 V_1 + l2 v, formed as the kernels load each block
    (the gradients of v, V_1 and (l1, l2) come from the dK/dV kernel: no pass over memory for the mix);
    lambda_grads=False: (l1, l2) are constants (the paper's fixed 1/2, 1/2), their gradient is not computed and
    reads as zero (pass them through lax.stop_gradient). `rope` (positions [B, T], inv_freq [D/2]): q and k come
    before RoPE; they are rotated here (rotate_half) and the dQ and dK/dV kernels rotate their gradients back as
    they write them, where XLA would take a pass over dQ and dK of its own."""
    _B, T, H, D = q_BxTxHxD.shape
    S, K = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
    if H % K:
        raise ValueError(f"{K} kv heads do not divide {H} query heads")
    if causal and T != S:
        raise ValueError(f"causal flash attention needs equal query and key lengths, got T={T}, S={S}")
    bq, bk = choose_blocks(
        T, S, D, jnp.dtype(q_BxTxHxD.dtype).itemsize, block_q, block_k, budget=smem_budget(target_device_kind())
    )
    if segments_BxT is not None and not causal:
        raise ValueError("packed documents (segment ids) are for causal attention")
    if rope is not None and (D < 32 or D & (D - 1)):
        raise ValueError(f"RoPE in the kernel takes head_dim a power of two >= 32 (its halves Triton blocks), got {D}")
    mix = None if value_mix is None else (value_mix[0], value_mix[1])
    if D & (D - 1):  # Triton's blocks are powers of two: zero columns add nothing to q.k and give zero outputs, cut
        Dp = 1 << (D - 1).bit_length()
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, Dp - D)))
        mix = None if mix is None else (pad(mix[0]), mix[1])
        bq, bk = choose_blocks(
            T, S, Dp, jnp.dtype(q_BxTxHxD.dtype).itemsize, block_q, block_k, budget=smem_budget(target_device_kind())
        )
        out = _flash(pad(q_BxTxHxD), pad(k_BxSxKxD), pad(v_BxSxKxD), segments_BxT, mix, None, causal, bq, bk,
                     lambda_grads, D)  # fmt: skip
        return out[..., :D]
    return _flash(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, segments_BxT, mix, rope, causal, bq, bk, lambda_grads)
