"""The decoder: layer 1 as its own module, layers 2..N as one nn.scan, LM head.

  H_0 = Embed(tokens)
  layer 1:   H_1 = H_0 + Attn_1(RMSNorm(H_0)) ...; it produces V_1 (and Q_1, K_1)
  layer n:   H_n = H_{n-1} + Attn_n(RMSNorm(H_{n-1}); V_1) + MLP(...)
  logits = RMSNorm(H_N) W_out         (untied from the input embedding)

V_1 reaches every scanned layer as a broadcast input (`Context.first`), never
through the carry, so the scan's carry is only the hidden state (plus what an
ablation needs, `Carry`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from resformer_jax import kernels
from resformer_jax.kernels import cpu_matmul, names
from resformer_jax.kernels.names import ATTENTION_RESIDUALS
from resformer_jax.model.attention import (
    VALUE_MIX,
    Attention,
    Carry,
    Context,
    LayerTensors,
    PageLayout,
    first_carry,
    next_carry,
    plan_layer,
)
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.lambdas import block_lambdas, stack_lambdas
from resformer_jax.model.layers import DenseGeneral, Embed, GeluMLP, LayerNorm, RMSNorm, SwiGLU, normal_init


def norm(m: ModelConfig, dtype, name: str, mesh=None, kernel: bool = True) -> nn.Module:
    """Pre-norm: RMSNorm (Llama) or LayerNorm (GPT-2); RMSNorm in the Pallas kernels where the config puts it there
    (ModelConfig.norms_in_kernel) and the caller trains or evaluates (kernel=False: decoding, the analysis capture)."""
    if m.arch == "gpt2":
        return LayerNorm(m.norm_eps, dtype, name=name)
    return RMSNorm(m.norm_eps, dtype, kernel=kernel and m.norms_in_kernel, mesh=mesh, name=name)


def mlp(m: ModelConfig, dtype) -> nn.Module:
    """SwiGLU (Llama) or GELU (GPT-2)."""
    return (GeluMLP if m.arch == "gpt2" else SwiGLU)(
        m.ffn_dim, m.init_std, dtype, out_std=m.output_init_std, matmuls=m.matmuls, name="mlp"
    )


def dropout(module: nn.Module, m: ModelConfig, x):
    """GPT-2's embedding and residual dropout (model.dropout); active only when the caller passes a dropout rng
    (training), never in evaluation, decoding or analysis."""
    rate = float(m.dropout)
    if rate <= 0 or not module.has_rng("dropout"):
        return x
    return nn.Dropout(rate, deterministic=False)(x)


def output_embedding(params, m: ModelConfig):
    """W_out [E, V]: the LM head, or the transposed input embedding when tied (GPT-2)."""
    if m.tie_embeddings:
        return nn.unbox(params["embed"]["embedding"]).T
    return nn.unbox(params["lm_head"]["kernel"])


def lm_head_logits(m: ModelConfig, params, h_BxKxE):
    """fp32 logits [B, K, vocab] of final hidden states (`return_hidden=True`'s output, or some positions of
    it), computed as the model's own LM head computes them."""
    dtype = jnp.dtype(m.dtype)
    if m.tie_embeddings:
        table_VxE = nn.unbox(params["embed"]["embedding"])
        if m.matmuls == "rounded" and dtype != jnp.float32:
            return cpu_matmul.rounded_matmul(h_BxKxE.astype(dtype), table_VxE.T)
        return jnp.dot(h_BxKxE, table_VxE.T.astype(dtype), preferred_element_type=jnp.float32)
    return lm_head(m).apply({"params": params["lm_head"]}, h_BxKxE)


def lm_head(m: ModelConfig, name: str | None = None) -> DenseGeneral:
    """W_out as its own parameter [E, V] (untied): fp32 logits from the compute dtype."""
    return DenseGeneral(
        (m.vocab_size,),
        ("embed", "vocab"),
        std=m.init_std,
        dtype=jnp.dtype(m.dtype),
        out_dtype=jnp.float32,
        matmuls=m.matmuls,
        name=name,
    )


log = logging.getLogger(__name__)


def remat_policy(name: str):
    """The named rematerialisation policies (config.model.remat): what the backward may keep."""
    return {
        # matmul outputs kept, and the value a layer forms (Eq. 7's mix): its recompute would read V_1 again, the
        # dearest part of Eq. 7 on a TPU, whose kernel does not form the mix (docs/scaling-out.md)
        "dots": jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.save_only_these_names(VALUE_MIX),
        ),
        "full": jax.checkpoint_policies.nothing_saveable,  # everything recomputed
        # the attention kernel's inputs, output and log-sum-exp kept; the projections and the MLP recomputed
        "attention": jax.checkpoint_policies.save_only_these_names(ATTENTION_RESIDUALS),
    }[name]


def needs_unrolled(m: ModelConfig) -> str | None:
    """Why a config cannot use the scanned stack (layers differ in structure), or None."""
    if m.denseformer:
        return "denseformer mixes all earlier block outputs"
    if m.cla_share_every > 1:
        return "CLA layers differ in which projections they own"
    if tuple(m.svformer_anchors):
        return "SVFormer anchor layers own a value projection"
    if m.value_embeddings:
        return "value embeddings apply to the first and last layers only"
    return None


def document_segments(tokens_BxT, eot: int):
    """Packed documents, each ended by the `eot` token: (each token's document [B, T], its position within it
    [B, T]). The end-of-text token is its document's last; the token after it starts the next at position 0."""
    B, T = tokens_BxT.shape
    is_eot_BxT = (tokens_BxT == eot).astype(jnp.int32)
    segments_BxT = jnp.cumsum(is_eot_BxT, axis=1) - is_eot_BxT
    idx_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    starts_BxT = jnp.concatenate([jnp.ones((B, 1), jnp.int32), is_eot_BxT[:, :-1]], axis=1)
    first_BxT = jax.lax.cummax(jnp.where(starts_BxT > 0, idx_BxT, 0), axis=1)
    return segments_BxT, idx_BxT - first_BxT


def attended_fraction(tokens_BxT, eot: int):
    """The share of causal attention's (query, key) pairs that packed documents keep: each query attends its
    position within its document + 1 keys, of the t + 1 a whole sequence's query t attends (what the model FLOPs
    of attention shrink by; the mask itself is computed all the same by kernels that skip nothing)."""
    T = tokens_BxT.shape[1]
    _, positions_BxT = document_segments(tokens_BxT, eot)
    return jnp.sum(positions_BxT + 1) / (tokens_BxT.shape[0] * T * (T + 1) / 2)


class DecoderBlock(nn.Module):
    """Pre-norm block: h + Attn(RMSNorm(h)), then h + SwiGLU(RMSNorm(h))."""

    cfg: ModelConfig
    layer: int | None  # 1-based; None in the scan (a generic layer >= 2)
    paged: bool = False
    capture: bool = False
    planner: Callable = plan_layer  # (model cfg, layer) -> LayerPlan

    @nn.compact
    def __call__(self, carry: Carry, ctx: Context, lam_2) -> tuple[Carry, LayerTensors]:
        m = self.cfg
        dtype = jnp.dtype(m.dtype)
        whole = not (self.paged or self.capture) and kernels.context_size(ctx.mesh) == 1  # kernels may fuse (in_mode)
        plan = self.planner(m, self.layer).in_mode(whole)
        lam_2 = block_lambdas(self, m, self.layer, lam_2)
        kernel = not (self.paged or self.capture)
        # the stream passes through each norm, so a kernel's backward adds its gradient in the norm's own pass
        h_BxTxE, x_BxTxE, x_kv_BxTxE = norm(m, dtype, "attn_norm", ctx.mesh, kernel)(carry.h, passes=True, outputs=2)
        attn_out, tensors = Attention(m, plan, self.paged, self.capture, name="attn")(
            x_BxTxE, ctx, carry, lam_2, x_kv_BxTxE
        )
        h_BxTxE = h_BxTxE + dropout(self, m, attn_out)
        h_BxTxE, y_BxTxE = norm(m, dtype, "mlp_norm", ctx.mesh, kernel)(h_BxTxE, passes=True)
        h_BxTxE = h_BxTxE + dropout(self, m, mlp(m, dtype)(y_BxTxE))
        if self.capture:
            self.sow("intermediates", "hidden", h_BxTxE)
        if plan.first:
            return dataclasses.replace(carry, h=h_BxTxE), tensors
        return next_carry(plan, carry, h_BxTxE, tensors), tensors


class ScannedBlock(nn.Module):
    """DecoderBlock in scan form: (carry, per-layer lambdas) -> (carry, None)."""

    cfg: ModelConfig
    paged: bool = False
    capture: bool = False
    planner: Callable = plan_layer

    @nn.compact
    def __call__(self, carry, ctx, lam_2):
        new, _ = DecoderBlock(self.cfg, None, self.paged, self.capture, self.planner, name="block")(carry, ctx, lam_2)
        return new, None


class Transformer(nn.Module):
    """Token ids [B, T] -> fp32 logits [B, T, vocab]: a whole sequence, or (with `pages`) tokens at positions over
    the engine's paged cache; `capture` records the per-layer tensors the analysis reads."""

    cfg: ModelConfig  # typed at the edge: config.RunConfig.of (a run's config), load_run (a saved run's)
    capture: bool = False
    pages: PageLayout | None = None  # a paged cache (engine/): each layer's K/V pool
    planner: Callable = plan_layer  # (model cfg, layer) -> LayerPlan; tests pass a toy variant's
    mesh: Any = None  # the device mesh: attention kernels that XLA cannot partition run per batch shard

    def __post_init__(self):
        m = self.cfg
        if not isinstance(m, ModelConfig):
            raise TypeError(
                f"Transformer takes a ModelConfig, got {type(m).__name__}: type the run's config once with "
                "config.RunConfig.of(cfg) and pass its .model"
            )
        unresolved = [f for f in ("attention_impl", "norm_impl", "matmuls", "dtype") if getattr(m, f) == "auto"]
        if unresolved:
            raise TypeError(
                f"Transformer takes a resolved ModelConfig; {', '.join(unresolved)} still 'auto': resolve it once, "
                "with resformer_jax.resolve.for_backend(m) (a model built by hand) or resolve.resolve(cfg) (a run)"
            )
        super().__post_init__()

    def context_parallel(self, batch: int) -> bool:
        """Whether the sequence is split over the mesh's context axis (a batch that does not divide over the batch
        axes, as model.init's, runs whole)."""
        if kernels.context_size(self.mesh) == 1:
            return False
        return batch % (self.mesh.shape["data"] * self.mesh.shape["fsdp"]) == 0

    def batch_split(self, batch: int) -> bool:
        """Whether the rows are split over the mesh's batch axes (training and evaluation on a mesh; not over the
        paged cache, whose engine splits its rows itself, nor a batch that does not divide, as model.init's)."""
        if self.mesh is None or self.pages is not None:
            return False
        return batch % (self.mesh.shape["data"] * self.mesh.shape["fsdp"]) == 0

    @nn.compact
    def __call__(self, tokens_BxT, positions_BxT=None, return_hidden: bool = False, page_table_BxP=None):
        """return_hidden: stop before the LM head and return RMSNorm(H_N) [B, T, E]
        (the training loss applies the head itself, a block at a time). With `pages`: each token's position
        (-1: padding, written nowhere that is read) and each row's pages (`page_table_BxP`, engine/pages.py)."""
        m = self.cfg
        dtype = jnp.dtype(m.dtype)
        B, T = tokens_BxT.shape
        paged = self.pages is not None
        segments_BxT = None
        if positions_BxT is None and not paged and m.document_eot >= 0:
            segments_BxT, positions_BxT = document_segments(tokens_BxT, m.document_eot)
        elif positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
        context = not paged and self.context_parallel(B)
        if context:  # the sequence in the balanced order of a context axis (kernels.balanced_order); undone below
            order = names.balanced_order(T, kernels.context_size(self.mesh))
            tokens_BxT, positions_BxT = tokens_BxT[:, order], positions_BxT[:, order]
            segments_BxT = None if segments_BxT is None else segments_BxT[:, order]
        ctx = Context(
            positions=positions_BxT, mesh=self.mesh, segments=segments_BxT, pages=self.pages, page_table=page_table_BxP
        )

        h_BxTxE = Embed(m.vocab_size, m.d_model, m.init_std, dtype, name="embed")(tokens_BxT)
        if m.arch == "gpt2":  # learned absolute positions
            pos_PxE = self.param(
                "pos_embed", normal_init(m.init_std, None, "embed"), (m.max_seq_len, m.d_model), jnp.float32
            )
            h_BxTxE = h_BxTxE + jnp.take(pos_PxE, positions_BxT, axis=0).astype(dtype)
        h_BxTxE = dropout(self, m, h_BxTxE)
        # Each device keeps its rows (and under mesh.context its slices of the sequence) from here on: the lookup
        # inherits the table's fsdp-split E, and without this layer 1 ran on every row with E split (partial sums
        # of the whole batch all-reduced: docs/scaling-out.md).
        if self.batch_split(B):
            h_BxTxE = kernels.on_context(h_BxTxE, self.mesh, split=context)
        if m.value_embeddings:  # one lookup a table, [B, T, K, D], read by the layers that add it to their value
            K, D = m.kv_heads, m.head_dim
            table = lambda j: Embed(m.vocab_size, K * D, m.init_std, dtype, name=f"value_embed_{j}")
            tables = tuple(table(j)(tokens_BxT).reshape(B, T, K, D) for j in range(m.value_embeddings))
            ctx = dataclasses.replace(ctx, value_embeds=tables)
        if self.capture:
            self.sow("intermediates", "embedding_output", h_BxTxE)
        lams_Mx2 = stack_lambdas(self, m)  # M = num_layers - 1: (l1, l2) of each layer after the first

        block_cls = DecoderBlock
        if m.remat != "none" and not paged:
            block_cls = nn.remat(DecoderBlock, policy=remat_policy(m.remat), static_argnums=())

        # Layer 1: a standard layer that produces V_1 (and Q_1, K_1) for every later layer.
        carry, first = block_cls(m, 1, paged, self.capture, self.planner, name="layer_1")(
            Carry(h=h_BxTxE), ctx, lams_Mx2[0]
        )
        if context and first.v is not None:  # V_1 gathered over the context axis once, read by every later layer
            first = first._replace(v=kernels.on_context(first.v, self.mesh, split=False))
        ctx = dataclasses.replace(ctx, first=first)
        carry = first_carry(m, carry.h, first)

        why_unrolled = needs_unrolled(m)
        if m.scan_layers and why_unrolled is None:
            scan = nn.scan(
                nn.remat(ScannedBlock, policy=remat_policy(m.remat), prevent_cse=False)
                if m.remat != "none" and not paged
                else ScannedBlock,
                variable_axes={"params": 0, "cache": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, 0),
                length=m.num_layers - 1,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            carry, _ = scan(m, paged, self.capture, self.planner, name="layers")(carry, ctx, lams_Mx2)
        else:
            if m.scan_layers and why_unrolled:
                log.warning("scan_layers=True but %s; running the layers unrolled.", why_unrolled)
            outputs = [h_BxTxE, carry.h]  # DenseFormer: embedding output and every block output
            if m.denseformer:
                carry = dataclasses.replace(carry, h=DenseFormerAverage(2, name="dwa_1")(outputs))
            for n in range(2, m.num_layers + 1):
                carry, _ = block_cls(m, n, paged, self.capture, self.planner, name=f"layer_{n}")(
                    carry, ctx, lams_Mx2[n - 2]
                )
                if m.denseformer:
                    outputs.append(carry.h)
                    carry = dataclasses.replace(carry, h=DenseFormerAverage(len(outputs), name=f"dwa_{n}")(outputs))
        h_BxTxE = carry.h
        if context:  # back in the sequence's order, still split over the context axis
            h_BxTxE = kernels.on_context(h_BxTxE[:, np.argsort(order)], self.mesh)

        h_BxTxE = norm(m, dtype, "final_norm", self.mesh, not (paged or self.capture))(h_BxTxE)
        if self.capture:
            self.sow("intermediates", "final_norm_output", h_BxTxE)
        if return_hidden:
            return h_BxTxE
        if m.tie_embeddings:  # the head is the input embedding: no parameter of its own to create
            return lm_head_logits(m, self.variables["params"], h_BxTxE)
        return lm_head(m, name="lm_head")(h_BxTxE)


class DenseFormerAverage(nn.Module):
    """Depth-weighted average over [H_0, ..., H_i], init one-hot on H_i (Pagliardini et al. 2024).
    Ignoring the output projections and MLPs, the paper writes it as Eq. 9: U_n = sum_i alpha_i A_i V_i."""

    n: int

    @nn.compact
    def __call__(self, outputs):
        init = np.zeros(self.n, np.float32)
        init[-1] = 1.0
        alpha = self.param("alpha", nn.with_logical_partitioning(lambda *_: jnp.asarray(init), ("layers",)), (self.n,))
        return sum(alpha[i].astype(o.dtype) * o for i, o in enumerate(outputs))


def unrolled_params(params: dict, num_layers: int) -> dict:
    """Scanned parameters ({'layers': {'block': [L-1, ...]}}) as one subtree per layer ({'layer_n': ...}): what the
    unrolled stack (scan_layers=False) reads. Unscanned parameters are returned as they are."""
    if "layers" not in params:
        return dict(params)
    out = {k: v for k, v in params.items() if k != "layers"}
    stacked = params["layers"]["block"]
    for i in range(num_layers - 1):
        out[f"layer_{i + 2}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return out


def shapes_only(m: ModelConfig) -> ModelConfig:
    """`m` for tracing shapes alone: XLA's attention and norm and the plain matmuls (the kernels hold no parameters
    and lay out the same bytes), never a GPU kernel interpreted on the host (a compile target's model)."""
    return m.replace(attention_impl="xla", norm_impl="xla", matmuls="plain")


def param_shapes(m: ModelConfig, boxed: bool = False):
    """Parameter shapes without allocating them (jax.eval_shape); boxed: keep the logical axis names. Traced once
    per model config (a 24-layer trace takes seconds, and the memory estimate asks for it once per setting it
    weighs); each call gets its own tree."""
    return jax.tree.map(lambda x: x, _traced_param_shapes(m, boxed))


@functools.lru_cache(maxsize=16)
def _traced_param_shapes(m: ModelConfig, boxed: bool):
    model = Transformer(shapes_only(m).replace(dtype="float32"))  # parameters are float32 whatever the dtype
    T = min(8, m.max_seq_len)
    variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, T), jnp.int32)))
    return variables["params"] if boxed else nn.unbox(variables["params"])


def param_counts(m: ModelConfig) -> dict:
    shapes = param_shapes(m)
    total = int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)))
    embed = int(
        np.prod(shapes["embed"]["embedding"].shape)
        + (np.prod(shapes["lm_head"]["kernel"].shape) if "lm_head" in shapes else 0)
        + (np.prod(shapes["pos_embed"].shape) if "pos_embed" in shapes else 0)
    )
    # value-embedding tables: embeddings too, counted apart so that parameter-matched comparisons are possible
    value_tables = int(sum(np.prod(v["embedding"].shape) for k, v in shapes.items() if k.startswith("value_embed_")))
    out = {"params_total": total, "params_non_embedding": total - embed - value_tables}
    if value_tables:
        out["params_value_embeddings"] = value_tables
    return out


def pool_shapes(model: Transformer):
    """The cache pools of a paged model as shapes: {layer: {"k": pool, "v": ...}} as each layer's equation needs
    them, each laid out for its kernel (kernels/paged_attention.pool_shape; nothing allocated). Traced once per
    model (an engine, its memory plan and its byte counts each ask); each call gets its own tree."""
    return jax.tree.map(lambda x: x, _traced_pool_shapes(model))


@functools.lru_cache(maxsize=16)
def _traced_pool_shapes(model: Transformer):
    one = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), one, one, page_table_BxP=one))["cache"]


def cache_bytes_per_token(m: ModelConfig) -> int:
    """Bytes a token takes in the paged cache, every layer together (what the engine's pools hold per page slot)."""
    shapes = pool_shapes(Transformer(shapes_only(m).replace(scan_layers=False), pages=PageLayout(1, 1)))
    return int(sum(np.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes)))
