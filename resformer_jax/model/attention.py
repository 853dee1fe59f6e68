"""Attention with value-residual mixing (paper Sec. 3) and the engine's paged KV cache.

Layer n projects Q_n, K_n, V_n from its normed input. Layer 1 is standard and
its tensors reach every later layer (`Context.first`). For n >= 2 the layer
attends with its own A_n over a mix of values:

  none        U_n = A_n V_n                                    (Eq. 1)
  resformer   U_n = A_n (l1 V_1 + l2 V_n)                      (Eq. 7, l1 = l2 = 1/2; Eq. 4 with m = 1)
  svformer    U_n = A_n V_1                                    (Eq. 10)
  neutreno    U_n = A_n V_n + lam (V_1 - V_n)                  (Eq. 8)
  skipv1      U_n = A_n [V_n^{1..K-r}; V_1^{K-r+1..K}]         (SkipV1Former: r of K value heads are layer 1's)
  gated       U_n = A_n ((1 - g) V_n + g V_1), g = sigmoid(x W_g) per value head and token (x-transformers)

What a layer does is decided once, by `plan_layer`, into a `LayerPlan`; the
module then reads like the equations, one short function per equation. To
add a variant: its equation function here and its case in `plan_layer` (a new
value mix is a function of `ValueMix`; tests/project/test_structure.py adds one).

Values stay in key/value-head layout [B, T, K, D] (before GQA repetition) and
are never rotated. Over a paged cache each layer keeps only what its equation
needs: K for every layer that owns keys, V only where the layer owns values
(SVFormer: once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.ad_checkpoint import checkpoint_name

from resformer_jax.kernels import attention as dispatch
from resformer_jax.kernels import paged_attention
from resformer_jax.kernels import rope as kernel_rope
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.lambdas import fixed_lambdas
from resformer_jax.model.layers import DenseGeneral, rope, rope_frequencies

# The remat name of the value a layer attends over where it forms one (LayerPlan.forms_value).
VALUE_MIX = "value_mix"

# ----------------------------------------------------------------------------- the plan


def rope_inv_freq(m: ModelConfig):
    """RoPE's inverse frequencies for the model (None: plain RoPE, computed in the kernel as always)."""
    if m.rope_type == "default":
        return None
    return rope_frequencies(
        m.head_dim,
        m.rope_theta,
        m.rope_type,
        m.rope_factor,
        m.rope_low_freq_factor,
        m.rope_high_freq_factor,
        m.rope_original_max_position,
    )


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one layer computes, resolved once from the config."""

    first: bool  # layer 1: standard attention; its Q, K, V reach every later layer
    query: str  # "own" | "first" (SVFormer sharing Q_1, Fig. 13)
    key: str  # "own" | "first" (SVFormer sharing K_1, Fig. 13) | "group" (CLA: the group's first layer)
    value: str  # "own" | "none" (SVFormer: no W_V at all, Eq. 10) | "group" (CLA)
    value_source: str | None  # the earlier value the residual uses (Fig. 8): first | previous | mean_of_previous
    mix: Callable[[ValueMix], jax.Array]  # the value A_n is applied to: eq1_own_value | eq7_resformer_value |
    #                                         eq5_mean_value | eq10_svformer_value
    residual_on: str | None  # "q" | "k": Eq. 7's mix on queries or keys instead of values (Fig. 6)
    mapping: str  # how the earlier value reaches U_n: attention (Eq. 4) | identity (Eq. 6) | cross_layer (Eq. 2)
    neutreno: float  # Eq. 8's lambda; 0 = off
    anchor: bool  # SVFormer anchor (Fig. 14): this layer's own V becomes the shared value
    own_value_heads: int = 0  # heads of the layer's W_V (all K unless SkipV1Former reuses some of layer 1's)
    gate: bool = False  # the mix's weight is a gate of the layer input (resformer_lambdas=gated)
    value_table: int = -1  # the value-embedding table added to V_n (model.value_embeddings), -1: none
    value_table_gate: bool = False  # added through a gate of the layer input instead of two scalars
    mix_in_kernel: bool = False  # Eq. 7 (or the gated mix) formed by the attention kernel as it loads V (pallas)
    # Eq. 7's fixed weights applied in the values' dtype where it holds them exactly (1/2 in bf16): the same mix,
    # without fp32 copies of V_1 and V_n (docs/scaling-out.md: the 7B's step bound)
    lambdas_in_value_dtype: bool = False
    rope_in_kernel: bool = False  # RoPE's gradients rotated back by the dQ and dK/dV kernels as they write (pallas)

    @property
    def forms_value(self) -> bool:
        """Whether the value A_n is applied to is a tensor this layer forms (Eq. 7, Eq. 5, the gate's mix,
        SkipV1Former's heads) rather than a projection's output (Eq. 1) or layer 1's (Eq. 10)."""
        return self.mix not in (eq1_own_value, eq10_svformer_value)

    @property
    def owns(self) -> tuple[bool, bool, bool]:
        """Which of W_Q, W_K, W_V the layer has (a layer without one has no parameter for it)."""
        return self.query == "own", self.key == "own", self.value == "own"

    def in_mode(self, whole: bool) -> LayerPlan:
        """The plan as one call runs it, its fusion decided here once: Eq. 7's mix and RoPE go into the attention
        kernel only over a whole sequence on one device (training, evaluation; `whole`), never over the paged
        cache, in the analysis' capture or on a context axis, and RoPE not in Eq. 2's attention over two caches."""
        rope = self.rope_in_kernel and whole and not (self.mapping == "cross_layer" and not self.first)
        return dataclasses.replace(self, mix_in_kernel=self.mix_in_kernel and whole, rope_in_kernel=rope)


def _rope_in_kernel(m: ModelConfig | None) -> bool:
    """The Pallas kernel takes q and k before RoPE (its backward's halves of the head are Triton blocks: head_dim a
    power of two, at least 32)."""
    D = m.head_dim if m is not None else 0
    return m is not None and m.uses_rope and m.attention_impl == "pallas" and D >= 32 and D & (D - 1) == 0


def _first_layer_plan(m: ModelConfig | None = None) -> LayerPlan:
    return LayerPlan(
        rope_in_kernel=_rope_in_kernel(m),
        value_table=m.value_table(1) if m is not None else -1,
        value_table_gate=bool(m is not None and m.value_embedding_gate),
        first=True,
        query="own",
        key="own",
        value="own",
        value_source=None,
        mix=eq1_own_value,
        residual_on=None,
        mapping="attention",
        neutreno=0.0,
        anchor=False,
    )


def kernel_can_mix_values(m: ModelConfig) -> bool:
    """Whether the layers >= 2 attend over a value mix the Pallas kernel can form itself (Eq. 7), so that `auto`
    times the kernels on it (kernels/probe.py probe_auto, value_mix)."""
    return m.num_layers > 1 and plan_layer(dataclasses.replace(m, attention_impl="pallas"), 2).mix_in_kernel


def plan_layer(m: ModelConfig, layer: int | None) -> LayerPlan:
    """The plan of 1-based layer `layer`; None is a generic layer >= 2 (inside the scan, where
    no layer has a structure of its own: configs with CLA or anchors run unrolled)."""
    if layer == 1:
        return _first_layer_plan(m)
    at = lambda pred: layer is not None and pred(layer)
    cla_reuse = m.cla_share_every > 1 and at(lambda n: (n - 1) % m.cla_share_every != 0)
    anchor = m.shares_first_value and at(lambda n: n in tuple(m.svformer_anchors))
    shares = m.svformer_share if m.shares_first_value and not anchor else None  # what layer n takes from layer 1
    key = "group" if cla_reuse and m.cla_share in ("kv", "k") else "first" if shares == "k" else "own"
    value = "group" if cla_reuse and m.cla_share in ("kv", "v") else "none" if shares == "v" else "own"
    resformer = m.mixes_values
    own_heads = m.kv_heads - m.skipv1_heads
    if m.reuses_first_value_heads:
        value = "own" if own_heads else "none"
    if m.mapping != "attention" or m.residual_on != "v" or not (resformer or shares == "v" or m.skipv1_heads):
        mix = eq1_own_value
    elif m.skipv1_heads:
        mix = skipv1_value
    elif m.gates_values:
        mix = gated_value
    elif resformer:
        mix = eq5_mean_value if m.value_source == "mean_of_previous" else eq7_resformer_value
    else:
        mix = eq10_svformer_value
    return LayerPlan(
        first=False,
        query="first" if shares == "q" else "own",
        key=key,
        value=value,
        value_source=m.value_source,
        mix=mix,
        residual_on=m.residual_on if resformer and m.residual_on != "v" else None,
        mapping=m.mapping,
        neutreno=m.neutreno if m.uses_neutreno else 0.0,
        anchor=anchor,
        own_value_heads=own_heads,
        gate=m.gates_values and mix is gated_value,
        mix_in_kernel=mix in (eq7_resformer_value, gated_value)
        and m.attention_impl == "pallas"
        and not m.uses_neutreno,
        rope_in_kernel=_rope_in_kernel(m),
        value_table=m.value_table(layer),
        value_table_gate=m.value_embedding_gate,
        lambdas_in_value_dtype=resformer and _fixed_lambdas_exact_in(m),
    )


def _fixed_lambdas_exact_in(m: ModelConfig) -> bool:
    """Whether Eq. 7's (l1, l2) are constants that the model's dtype holds exactly (so a mix in it is the fp32 mix
    rounded once, as the fp32 mix is when cast back)."""
    if m.learns_lambdas:
        return False
    fixed = fixed_lambdas(m)
    return bool(np.array_equal(fixed.astype(jnp.dtype(m.dtype)).astype(np.float32), fixed))


# ----------------------------------------------------------------------------- what flows between layers


class LayerTensors(NamedTuple):
    """A layer's projections, the value its attention used, and the K/V it attended (paged: the layer's cache)."""

    q: jax.Array  # [B, T, H, D], before RoPE
    k: jax.Array  # [B, T, K, D], before RoPE
    v: Any  # [B, T, K, D] V_n; None where the layer has no W_V (SVFormer)
    v_att: Any  # the value A_n was applied to; None where the attention kernel formed it (plan.mix_in_kernel)
    k_all: jax.Array  # [B, S, K, D] the keys attended over (rotated where RoPE is not in the kernel; read over pages)
    v_all: Any  # [B, S, K, D] values attended over (None as v_att)


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """A paged decode cache (the engine's): each layer's cache is a pool of `num_pages` pages of `page_size`
    tokens, [heads, num_pages, page_size, D]; a sequence's tokens sit in the pages its row of the page table
    lists, in order. Page 0 is never a sequence's: padding tokens write there."""

    num_pages: int
    page_size: int


@struct.dataclass
class Context:
    """Inputs every layer >= 2 reads and nobody changes: positions, layer 1's tensors, the paged cache's table."""

    positions: jax.Array  # [B, T]
    first: LayerTensors | None = None
    mesh: Any = struct.field(pytree_node=False, default=None)  # the device mesh, for kernels run per shard
    value_embeds: Any = None  # model.value_embeddings: each table's lookup of this call's tokens, [B, T, K, D]
    pages: PageLayout | None = struct.field(pytree_node=False, default=None)  # a paged cache (engine/)
    page_table: Any = None  # paged: [B, P] each row's pages in order (0 past its end)
    segments: Any = None  # packed documents (model.document_eot): [B, T] each token's document, None: one


@struct.dataclass
class PagedKV:
    """A layer's paged cache as its attention reads it: the pool (laid out for `kernel`: paged_attention.pool_shape)
    of `heads` heads and the rows' page tables [B, P]."""

    pool: jax.Array
    table: jax.Array
    kernel: str = struct.field(pytree_node=False)  # paged_attention.kernel_for: who reads it
    heads: int = struct.field(pytree_node=False)


def dense_kv(x):
    """A cache as a contiguous [B, S, heads, D] array (a paged one gathered; a dense one as it is)."""
    return paged_attention.gather_pages(x.pool, x.table, x.kernel, x.heads) if isinstance(x, PagedKV) else x


@struct.dataclass
class Carry:
    """What the stack threads from layer to layer; fields an ablation does not use stay None."""

    h: jax.Array  # [B, T, E] hidden state
    # Each None unless the configured equations read it (typed Any: which are set is the plan's decision).
    v_prev: Any = None  # value_source=previous: V_{n-1}
    v_sum: Any = None  # value_source=mean_of_previous / mapping=identity: sum of earlier V (fp32)
    n_prev: Any = None  # how many values v_sum holds
    group: Any = None  # CLA: the LayerTensors of the group's first layer
    shared: Any = None  # SVFormer anchors: the LayerTensors of the layer whose V is the shared value


def first_carry(m: ModelConfig, h_BxTxE, first: LayerTensors) -> Carry:
    """The carry after layer 1: it holds only what the configured equations read later."""
    c = Carry(h=h_BxTxE)
    if m.value_source == "previous":
        c = dataclasses.replace(c, v_prev=first.v)
    if m.value_source.startswith("mean_of_previous") or m.mapping == "identity":
        c = dataclasses.replace(c, v_sum=first.v.astype(jnp.float32), n_prev=jnp.ones((), jnp.float32))
    if m.cla_share_every > 1:
        c = dataclasses.replace(c, group=first)
    return c


def next_carry(plan: LayerPlan, carry: Carry, h_BxTxE, t: LayerTensors) -> Carry:
    """The carry after a layer >= 2."""
    c = dataclasses.replace(carry, h=h_BxTxE)
    if carry.v_prev is not None and t.v is not None:
        c = dataclasses.replace(c, v_prev=t.v)
    if carry.v_sum is not None and t.v is not None:
        c = dataclasses.replace(c, v_sum=carry.v_sum + t.v.astype(jnp.float32), n_prev=carry.n_prev + 1)
    if carry.group is not None:  # CLA: the next layer of the group reuses these
        c = dataclasses.replace(c, group=t)
    if plan.anchor:
        c = dataclasses.replace(c, shared=t)
    return c


# ----------------------------------------------------------------------------- the equations


def repeat_kv(x_BxTxKxD, num_heads):
    """[B, T, K, D] -> [B, T, H, D] by repeating each kv head H/K times."""
    K = x_BxTxKxD.shape[2]
    return jnp.repeat(x_BxTxKxD, num_heads // K, axis=2)


def eq7_resformer_mix(earlier, own, l1, l2, dtype):
    """Eq. 7 (Eq. 4 with m = 1): l1 * earlier + l2 * own; l1 = l2 = 1/2 in the paper.
    Applied to values, or to queries / keys for the Fig. 6 ablation."""
    return (l1 * earlier + l2 * own).astype(dtype)


class ValueMix(NamedTuple):
    """What a value mix may combine: the layer's own V_n, the earlier value, the shared value."""

    # Each None where the plan's mix does not read it.
    own: Any  # V_n; None where the layer has no W_V
    earlier: Any  # the earlier value (value_source): V_1, V_{n-1} or the mean of V_1..V_{n-1}
    shared: Any  # SVFormer's shared value: V_1, or the latest anchor's V (Fig. 14)
    l1: jax.Array
    l2: jax.Array
    dtype: Any
    earlier_sum: Any = None  # sum of V_1..V_{n-1} (fp32), where the stack keeps it
    earlier_count: Any = None  # n - 1
    gate: Any = None  # [B, T, K] the learned gate toward the earlier value (resformer_lambdas=gated)


def eq1_own_value(x: ValueMix):
    """Eq. 1: U_n = A_n V_n (vanilla; also layer 1, and the Q/K/mapping ablations)."""
    return x.own


def eq7_resformer_value(x: ValueMix):
    """Eq. 7: U_n = A_n (l1 V_1 + l2 V_n)."""
    return eq7_resformer_mix(x.earlier, x.own, x.l1, x.l2, x.dtype)


def eq5_mean_value(x: ValueMix):
    """Eq. 5: U_n = (1/n) A_n sum_{i<=n} V_i (value_source=mean_of_previous with the attention mapping)."""
    return ((x.earlier_sum + x.own.astype(jnp.float32)) / (x.earlier_count + 1)).astype(x.dtype)


def eq10_svformer_value(x: ValueMix):
    """Eq. 10: U_n = A_n V_1 (or the value of the latest anchor layer, Fig. 14)."""
    return x.shared


def skipv1_value(x: ValueMix):
    """SkipV1Former (Wu et al., arXiv 2510.16807, Sec. 3): the layer's own value heads 1..K-r, then layer 1's
    heads K-r+1..K, each head its own index (r = 0: Eq. 1; r = K: Eq. 10)."""
    if x.own is None:
        return x.shared
    own_heads = x.own.shape[2]
    return jnp.concatenate([x.own, x.shared[:, :, own_heads:]], axis=2).astype(x.dtype)


def gated_value(x: ValueMix):
    """The learned value-residual mix of lucidrains/x-transformers: V = lerp(V_n, V_1, g) = (1 - g) V_n + g V_1
    with g = sigmoid(x W_g) per value head and token (g = 0: Eq. 1; g = 1: Eq. 10's value; W_g = 0: Eq. 7)."""
    g_BxTxKx1 = x.gate[..., None].astype(jnp.float32)
    return ((1.0 - g_BxTxKx1) * x.own + g_BxTxKx1 * x.earlier).astype(x.dtype)


def value_embedding_mix(v_BxTxKxD, ve_BxTxKxD, a, b, gate_BxTxK, dtype):
    """modded-nanogpt's value embeddings: V_n <- a V_n + b VE[token] (two learnable scalars a layer, init 1/2), or
    with the gate V_n <- V_n + g VE[token], g = 2 sigmoid(x W) per value head and token (W = 0: g = 1). b = 0 (a = 1)
    or g = 0 leaves V_n as it was."""
    if gate_BxTxK is not None:
        return (v_BxTxKxD + gate_BxTxK[..., None].astype(jnp.float32) * ve_BxTxKxD).astype(dtype)
    return (a * v_BxTxKxD + b * ve_BxTxKxD).astype(dtype)


def value_gate(m: ModelConfig) -> DenseGeneral:
    """W_g: [B, T, E] -> [B, T, K], zero-initialised (g = 1/2: ResFormer's fixed mix at the start)."""
    return DenseGeneral(
        (m.kv_heads,),
        ("embed", "kv_heads"),
        in_dims=1,
        std=0.0,
        dtype=jnp.dtype(m.dtype),
        matmuls=m.matmuls,
        name="value_gate",
    )


def mean_of_earlier_values(carry: Carry, dtype):
    """(1 / (n-1)) sum_{i<n} V_i: the average over earlier layers that Eq. 6 adds (value_source
    mean_of_previous_mixed mixes it with V_n through Eq. 7 instead)."""
    return (carry.v_sum / carry.n_prev).astype(dtype)


def earlier_value(plan: LayerPlan, carry: Carry, first: LayerTensors, dtype):
    """The earlier value the residual uses (Fig. 8): V_1, V_{n-1}, or the mean of V_1..V_{n-1}."""
    if plan.value_source == "previous":
        return carry.v_prev
    if plan.value_source in ("mean_of_previous", "mean_of_previous_mixed"):
        return mean_of_earlier_values(carry, dtype)
    return first.v


def eq6_identity_mapping(u_BxTxHxD, earlier_BxTxKxD):
    """Eq. 6: U_n = A_n V_n + (earlier value), mapped by the identity instead of A_n: exactly Eq. 6 with
    value_source=mean_of_previous (1/(n-1) sum_{i<n} V_i); with value_source=first, A_n V_n + V_1."""
    return u_BxTxHxD + repeat_kv(earlier_BxTxKxD, u_BxTxHxD.shape[2]).astype(u_BxTxHxD.dtype)


def eq8_neutreno(u_BxTxHxD, v1_BxTxKxD, v_att_BxTxKxD, lam: float):
    """Eq. 8: (A_n - lam J) V_n + lam V_1, with J V_n realised as each row's own value."""
    return u_BxTxHxD + lam * repeat_kv(v1_BxTxKxD - v_att_BxTxKxD, u_BxTxHxD.shape[2]).astype(u_BxTxHxD.dtype)


def eq2_cross_layer(qr_BxTxHxD, kr_BxTxKxD, v_BxTxKxD, k1r_BxTxKxD, v1_BxTxKxD):
    """Eq. 2: softmax(Q_n [K_n; K_1]^T / sqrt d) [V_n; V_1], causal within each half."""
    T = qr_BxTxHxD.shape[1]
    causal_TxT = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
    mask_1xTx2T = jnp.concatenate([causal_TxT, causal_TxT], axis=1)[None]
    return dispatch.reference_attention(
        qr_BxTxHxD,
        jnp.concatenate([kr_BxTxKxD, k1r_BxTxKxD], axis=1),
        jnp.concatenate([v_BxTxKxD, v1_BxTxKxD], axis=1),
        mask_BxTxS=mask_1xTx2T,
    )


# ----------------------------------------------------------------------------- the module


def projection(m: ModelConfig, heads: int, name: str) -> DenseGeneral:
    """W_Q (heads = H) or W_K / W_V (heads = K): [B, T, E] -> [B, T, heads, D]."""
    return DenseGeneral(
        (heads, m.head_dim),
        ("embed", "q_heads" if name == "query" else "kv_heads", "head_dim"),
        in_dims=1,
        std=m.init_std,
        dtype=jnp.dtype(m.dtype),
        use_bias=m.arch == "gpt2",
        matmuls=m.matmuls,
        name=name,
    )


def output_projection(m: ModelConfig, d_model: int) -> DenseGeneral:
    """W_O: [B, T, H, D] -> [B, T, E]."""
    return DenseGeneral(
        (d_model,),
        ("q_heads", "head_dim", "embed"),
        in_dims=2,
        std=m.output_init_std,
        dtype=jnp.dtype(m.dtype),
        use_bias=m.arch == "gpt2",
        matmuls=m.matmuls,
        name="out",
    )


class Attention(nn.Module):
    """One layer's attention: the paths for vanilla, ResFormer and SVFormer read as tests/support/reference.py does;
    the ablations are fields of the layer's plan. The paged cache and the analysis' capture have their own
    methods."""

    cfg: ModelConfig  # attention_impl already resolved from `auto` by the setup
    plan: LayerPlan
    paged: bool = False  # tokens at positions over the engine's paged cache
    capture: bool = False  # sow attention probabilities and values for analysis

    @nn.compact
    def __call__(self, x_BxTxE, ctx: Context, carry: Carry, lam_2, x_kv_BxTxE=None) -> tuple[jax.Array, LayerTensors]:
        """Returns (out_BxTxE, this layer's tensors). lam_2: (l1, l2) for this layer (model/lambdas.py).
        x_kv_BxTxE: the same input for the keys, values and gates (the norm's second output: its kernel sums the
        two groups' gradients itself); None: x_BxTxE."""
        m, p = self.cfg, self.plan
        x_kv = x_BxTxE if x_kv_BxTxE is None else x_kv_BxTxE
        dtype = jnp.dtype(m.dtype)
        first: Any = ctx.first  # layer 1's tensors (None in layer 1, whose plan reads nothing of them)
        l1, l2 = lam_2[0], lam_2[1]
        if p.lambdas_in_value_dtype:
            l1, l2 = l1.astype(dtype), l2.astype(dtype)

        q_BxTxHxD, k_BxTxKxD, v_BxTxKxD = self._project(x_BxTxE, x_kv, ctx, carry)

        # Fig. 6: Eq. 7's mix on queries or keys instead of values.
        if p.residual_on == "q":
            q_BxTxHxD = eq7_resformer_mix(first.q, q_BxTxHxD, l1, l2, dtype)
        elif p.residual_on == "k":
            k_BxTxKxD = eq7_resformer_mix(first.k, k_BxTxKxD, l1, l2, dtype)

        # The value this layer's attention matrix is applied to: V_n (Eq. 1), l1 V_1 + l2 V_n (Eq. 7), V_1 (Eq. 10).
        v_src = None if p.first else earlier_value(p, carry, first, dtype)
        shared = None if p.first else (carry.shared or first).v
        gate_BxTxK = jax.nn.sigmoid(value_gate(m)(x_kv).astype(jnp.float32)) if p.gate else None
        if gate_BxTxK is not None:
            self.sow("intermediates", "gate_mean", gate_BxTxK.mean())
        mix_in = ValueMix(v_BxTxKxD, v_src, shared, l1, l2, dtype, carry.v_sum, carry.n_prev, gate_BxTxK)
        # Eq. 7 (and RoPE) in the attention kernel where the plan says so for this mode (LayerPlan.in_mode)
        in_kernel, rope_in_kernel = p.mix_in_kernel, p.rope_in_kernel
        v_att_BxTxKxD = None if in_kernel else p.mix(mix_in)
        if v_att_BxTxKxD is not None and p.forms_value:  # kept by remat=dots: a recompute would read V_1 again
            v_att_BxTxKxD = checkpoint_name(v_att_BxTxKxD, VALUE_MIX)

        # RoPE on q and k (Llama); GPT-2 adds learned positions to the embeddings instead. The kernel that rotates
        # them itself takes them as they are.
        inv_freq = rope_inv_freq(m)
        rotate = (lambda x: rope(x, ctx.positions, m.rope_theta, inv_freq)) if m.uses_rope else (lambda x: x)
        qr_BxTxHxD, kr_BxTxKxD = (q_BxTxHxD, k_BxTxKxD) if rope_in_kernel else (rotate(q_BxTxHxD), rotate(k_BxTxKxD))
        rope_in = (ctx.positions, kernel_rope.inverse_frequencies(m.head_dim, m.rope_theta, inv_freq))

        # U_n = A_n V (Eq. 1, 4, 7, 10 alike: only V differs); Eq. 2 attends over layer n's and layer 1's K/V.
        k_all, v_all = kr_BxTxKxD, v_att_BxTxKxD
        if self.paged:
            u_BxTxHxD, k_all, v_all = self._attend_cached(qr_BxTxHxD, kr_BxTxKxD, v_att_BxTxKxD, v_BxTxKxD, ctx, carry)
        elif p.mapping == "cross_layer" and not p.first:
            u_BxTxHxD = eq2_cross_layer(qr_BxTxHxD, kr_BxTxKxD, v_BxTxKxD, rotate(first.k), first.v)
        elif self.capture:
            u_BxTxHxD = self._attend_captured(qr_BxTxHxD, kr_BxTxKxD, v_att_BxTxKxD, v_BxTxKxD)
        elif in_kernel:  # Eq. 7 (or the gate's mix) formed by the kernel as it loads V
            mix = (v_src, gate_BxTxK if p.gate else self._kernel_lambdas(l1, l2))
            u_BxTxHxD = self._attend(qr_BxTxHxD, kr_BxTxKxD, v_BxTxKxD, ctx, rope_in, value_mix=mix)
        else:
            u_BxTxHxD = self._attend(qr_BxTxHxD, kr_BxTxKxD, v_att_BxTxKxD, ctx, rope_in)

        # Corrections after the attention: Eq. 6's identity mapping, Eq. 8's NeuTRENO.
        if p.mapping == "identity" and not p.first:
            u_BxTxHxD = eq6_identity_mapping(u_BxTxHxD, v_src)
        if p.neutreno:
            u_BxTxHxD = eq8_neutreno(u_BxTxHxD, first.v, v_att_BxTxKxD, p.neutreno)

        out_BxTxE = output_projection(m, x_BxTxE.shape[-1])(u_BxTxHxD.astype(dtype))
        return out_BxTxE, LayerTensors(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, v_att_BxTxKxD, k_all, v_all)

    def _project(self, x_BxTxE, x_kv_BxTxE, ctx: Context, carry: Carry):
        """Q_n, K_n, V_n: a layer computes only the projections it owns (SVFormer n >= 2 has no W_V); the others
        are layer 1's or its group's (V None where the layer reads no value of its own)."""
        m, p = self.cfg, self.plan
        first: Any = ctx.first  # None in layer 1, whose plan reads nothing of it
        q_BxTxHxD = first.q if p.query == "first" else projection(m, m.num_heads, "query")(x_BxTxE)
        if p.key == "own":
            k_BxTxKxD = projection(m, m.kv_heads, "key")(x_kv_BxTxE)
        else:
            k_BxTxKxD = (carry.group if p.key == "group" else first).k
        if p.value == "own":  # SkipV1Former: K - r heads
            v_BxTxKxD = projection(m, p.own_value_heads or m.kv_heads, "value")(x_kv_BxTxE)
        else:
            v_BxTxKxD = carry.group.v if p.value == "group" else None
        if p.value_table >= 0 and v_BxTxKxD is not None:  # value embeddings: this layer's table added to V_n
            v_BxTxKxD = self._add_value_embedding(x_kv_BxTxE, v_BxTxKxD, ctx.value_embeds[p.value_table])
        return q_BxTxHxD, k_BxTxKxD, v_BxTxKxD

    def _attend(self, qr_BxTxHxD, kr_BxTxKxD, v_BxTxKxD, ctx: Context, rope_in, value_mix=None):
        """U_n = A_n V through the run's attention kernel (q and k unrotated where the plan rotates in it)."""
        m = self.cfg
        return dispatch.attention(
            qr_BxTxHxD,
            kr_BxTxKxD,
            v_BxTxKxD,
            causal=True,
            impl=m.attention_impl,
            mesh=ctx.mesh,
            segments_BxT=ctx.segments,
            value_mix=value_mix,
            lambda_grads=m.learns_lambdas,
            rope=rope_in if self.plan.rope_in_kernel else None,
        )

    def _kernel_lambdas(self, l1, l2):
        """(l1, l2) as the attention kernel takes them: fp32, constants cut from differentiation unless learned."""
        lam_2 = jnp.stack([l1, l2]).astype(jnp.float32)
        return lam_2 if self.cfg.learns_lambdas else jax.lax.stop_gradient(lam_2)

    def _add_value_embedding(self, x_BxTxE, v_BxTxKxD, ve_BxTxKxD):
        m, p = self.cfg, self.plan
        if p.value_table_gate:
            dtype, axes = jnp.dtype(m.dtype), ("embed", "kv_heads")
            w = DenseGeneral((m.kv_heads,), axes, std=0.0, dtype=dtype, matmuls=m.matmuls, name="ve_gate")
            gate_BxTxK = 2.0 * jax.nn.sigmoid(w(x_BxTxE).astype(jnp.float32))
            return value_embedding_mix(v_BxTxKxD, ve_BxTxKxD, None, None, gate_BxTxK, jnp.dtype(m.dtype))
        ab = self.param("ve_lambdas", nn.with_logical_partitioning(nn.initializers.constant(0.5), (None,)), (2,))
        return value_embedding_mix(v_BxTxKxD, ve_BxTxKxD, ab[0], ab[1], None, jnp.dtype(m.dtype))

    def _attend_cached(self, qr_BxTxHxD, kr_BxTxKxD, v_att_BxTxKxD, v_BxTxKxD, ctx: Context, carry: Carry):
        """Over the paged cache: this call's K and attended V go into the layer's pages, and the queries attend
        over the row's pages (a layer that owns no K or V reads the pages of the layer that does).
        Returns (U_n, the cached K, the cached V)."""
        first: Any = ctx.first
        k_all, v_all = self._cache(kr_BxTxKxD, v_att_BxTxKxD, ctx, carry)
        in_place = isinstance(k_all, PagedKV) and isinstance(v_all, PagedKV) and qr_BxTxHxD.shape[1] == 1
        if in_place and self.plan.mapping != "cross_layer" and not self.capture:
            # one new token a row: its pages read where they lie (a padding row, position -1, reads one token)
            lengths_B = jnp.maximum(ctx.positions[:, 0], 0) + 1
            u_BxHxD = paged_attention.paged_decode_attention(
                qr_BxTxHxD[:, 0], k_all.pool, v_all.pool, k_all.table, lengths_B, kernel=k_all.kernel
            )
            return u_BxHxD[:, None], k_all, v_all
        k_all, v_all = dense_kv(k_all), dense_kv(v_all)
        # a padding token (paged, position -1) attends to position 0: finite, and discarded
        mask_BxTxS = jnp.arange(k_all.shape[1])[None, None, :] <= jnp.maximum(ctx.positions, 0)[:, :, None]
        if self.plan.mapping == "cross_layer" and not self.plan.first:  # Eq. 2 over the caches of layers n and 1
            k_all_ = jnp.concatenate([k_all, dense_kv(first.k_all)], axis=1)
            v_all_ = jnp.concatenate([v_all, dense_kv(first.v_all)], axis=1)
            mask_BxTxS_ = jnp.concatenate([mask_BxTxS, mask_BxTxS], axis=-1)
            u_BxTxHxD, probs = dispatch.reference_attention(
                qr_BxTxHxD, k_all_, v_all_, mask_BxTxS=mask_BxTxS_, return_probs=True
            )
        else:
            u_BxTxHxD, probs = dispatch.reference_attention(
                qr_BxTxHxD, k_all, v_all, mask_BxTxS=mask_BxTxS, return_probs=True
            )
        if self.capture:
            self._sow_capture(probs, qr_BxTxHxD, kr_BxTxKxD, v_att_BxTxKxD, v_BxTxKxD)
        return u_BxTxHxD, k_all, v_all

    def _attend_captured(self, qr_BxTxHxD, kr_BxTxKxD, v_att_BxTxKxD, v_BxTxKxD):
        """The analysis: the reference attention, which also returns A_n, recorded with the layer's tensors."""
        u_BxTxHxD, probs = dispatch.reference_attention(qr_BxTxHxD, kr_BxTxKxD, v_att_BxTxKxD, return_probs=True)
        self._sow_capture(probs, qr_BxTxHxD, kr_BxTxKxD, v_att_BxTxKxD, v_BxTxKxD)
        return u_BxTxHxD

    def _sow_capture(self, probs, qr_BxTxHxD, kr_BxTxKxD, v_att_BxTxKxD, v_BxTxKxD):
        self.sow("intermediates", "attn_probs", probs.mean(axis=1))  # [B, T, S] averaged over heads
        self.sow("intermediates", "values", v_att_BxTxKxD)  # the value A_n is applied to
        # the layer's own V_n; where it has none or only some heads (SVFormer, SkipV1Former n >= 2): the value it
        # attends over
        whole = v_BxTxKxD is not None and v_BxTxKxD.shape[2] == v_att_BxTxKxD.shape[2]
        self.sow("intermediates", "values_own", v_BxTxKxD if whole else v_att_BxTxKxD)
        self.sow("intermediates", "queries", qr_BxTxHxD)  # rotated, as attended with (Fig. 3's measure)
        self.sow("intermediates", "keys", kr_BxTxKxD)

    def _cache(self, k_cur, v_cur, ctx: Context, carry: Carry):
        """The layer's K and V pages written at this call's positions (only what its equation owns)."""
        m, p = self.cfg, self.plan
        first: Any = ctx.first

        def own(name, cur, heads=m.kv_heads):
            return self._paged(name, cur, heads, ctx)

        if p.key == "own":
            k_all = own("k", k_cur)
        else:
            k_all = (carry.group if p.key == "group" else first).k_all
        if p.value == "own" and p.own_value_heads and p.own_value_heads < m.kv_heads:
            # SkipV1Former: the cache holds the layer's own heads only; layer 1's come from its cache
            own_heads = p.own_value_heads
            v_own = dense_kv(own("v", v_cur[:, :, :own_heads], own_heads))
            v_all = jnp.concatenate([v_own, dense_kv(first.v_all)[:, :, own_heads:]], 2)
        elif p.value == "own":
            v_all = own("v", v_cur)
        else:
            v_all = (carry.group if p.value == "group" else (carry.shared or first)).v_all
        return k_all, v_all

    def _paged(self, name: str, cur_BxTxKxD, heads: int, ctx: Context) -> PagedKV:
        """A paged cache: this call's tokens written at (their row's page for their position, the offset in it),
        padding (position -1) into page 0. The pool is laid out as the kernel that reads it wants
        (paged_attention.pool_shape); returned with the rows' page tables, read in place by a kernel or gathered."""
        m, pages = self.cfg, ctx.pages
        assert pages is not None
        kernel = paged_attention.kernel_for(m.attention_impl, m.head_dim)
        dtype = paged_attention.pool_dtype(kernel, m.dtype)
        shape = paged_attention.pool_shape(kernel, heads, pages.num_pages, pages.page_size, m.head_dim)
        pool = self.variable("cache", name, jnp.zeros, shape, dtype)
        table_BxP = ctx.page_table
        if not self.is_initializing():
            pos_BxT = ctx.positions
            slot_BxT = jnp.maximum(pos_BxT, 0) // pages.page_size
            page_BxT = jnp.where(pos_BxT >= 0, jnp.take_along_axis(table_BxP, slot_BxT, axis=1), 0)
            offset_BxT = jnp.where(pos_BxT >= 0, pos_BxT % pages.page_size, 0)
            pool.value = paged_attention.write_tokens(pool.value, page_BxT, offset_BxT, cur_BxTxKxD, kernel)
        return PagedKV(pool.value, table_BxP, kernel, heads)
