"""The decoder: layer 1 as its own module, layers 2..N as one nn.scan, LM head.

  H_0 = Embed(tokens)
  layer 1:   H_1 = H_0 + Attn_1(RMSNorm(H_0)) ...; it produces V_1 (and Q_1, K_1)
  layer n:   H_n = H_{n-1} + Attn_n(RMSNorm(H_{n-1}); V_1) + MLP(...)
  logits = RMSNorm(H_N) W_out         (untied from the input embedding)

V_1 reaches every scanned layer as a broadcast input, never through the carry,
so the scan's carry is only the hidden state (plus what an ablation needs).
"""
from __future__ import annotations

import logging
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from resformer_jax.model.attention import Attention
from resformer_jax.model.layers import DenseGeneral, Embed, RMSNorm, SwiGLU

log = logging.getLogger(__name__)

REMAT_POLICIES = {
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def needs_unrolled(m) -> str | None:
    """Why a config cannot use the scanned stack (layers differ in structure), or None."""
    if m.denseformer:
        return "denseformer mixes all earlier block outputs"
    if m.cla_share_every > 1:
        return "CLA layers differ in which projections they own"
    if tuple(m.svformer_anchors):
        return "SVFormer anchor layers own a value projection"
    return None


def layer_lambdas(m) -> np.ndarray:
    """(l1, l2) for layers 2..N as a [N-1, 2] array, for the non-learnable modes.

    `learnable` lambdas live in each block and are read there; this returns
    the fixed init as a placeholder for them.
    """
    n = m.num_layers - 1
    l1, l2 = (float(x) for x in m.lambda_init)
    if m.resformer_lambdas == "sparse":
        l1s = np.array([m.sparse_lambda if (i + 2) in tuple(m.sparse_layers) else 0.0 for i in range(n)], np.float32)
        return np.stack([l1s, np.ones(n, np.float32)], axis=1)
    return np.tile(np.array([[l1, l2]], np.float32), (n, 1))


class DecoderBlock(nn.Module):
    """Pre-norm block: h + Attn(RMSNorm(h)), then h + SwiGLU(RMSNorm(h))."""
    cfg: Any
    layer: int | None  # 1-based; None in the scan
    decode: bool = False
    capture: bool = False

    @nn.compact
    def __call__(self, carry, ctx, lam_2):
        m = self.cfg
        dtype = jnp.dtype(m.dtype)
        if m.value_residual in ("resformer", "resformer+neutreno") and self.layer != 1:
            if m.resformer_lambdas == "learnable":
                l1 = self.param("lambda1", nn.with_logical_partitioning(
                    nn.initializers.constant(m.lambda_init[0]), ()), (), jnp.float32)
                l2 = self.param("lambda2", nn.with_logical_partitioning(
                    nn.initializers.constant(m.lambda_init[1]), ()), (), jnp.float32)
                lam_2 = jnp.stack([l1, l2])
            elif m.resformer_lambdas == "learnable_plus":
                l2 = self.param("lambda2", nn.with_logical_partitioning(
                    nn.initializers.constant(m.lambda_init[1]), ()), (), jnp.float32)
                lam_2 = jnp.stack([lam_2[0], l2])
            self.sow("intermediates", "lambdas", lam_2)
        h_BxTxE = carry["h"]
        x_BxTxE = RMSNorm(m.norm_eps, dtype, name="attn_norm")(h_BxTxE)
        attn_out, produced = Attention(m, self.layer, self.decode, self.capture, name="attn")(
            x_BxTxE, ctx, carry, lam_2)
        h_BxTxE = h_BxTxE + attn_out
        y_BxTxE = RMSNorm(m.norm_eps, dtype, name="mlp_norm")(h_BxTxE)
        h_BxTxE = h_BxTxE + SwiGLU(m.ffn_dim, m.init_std, dtype, name="mlp")(y_BxTxE)
        if self.capture:
            self.sow("intermediates", "hidden", h_BxTxE)

        new = dict(carry, h=h_BxTxE)
        v = produced["v"]
        if "v_prev" in carry and v is not None:
            new["v_prev"] = v
        if "v_sum" in carry and v is not None:
            new["v_sum"] = carry["v_sum"] + v.astype(jnp.float32)
            new["n_prev"] = carry["n_prev"] + 1
        if "k_layer" in carry:  # CLA: the next layer of the group reuses these
            new.update(k_layer=produced["k"], v_layer=produced["v"],
                       k_all_layer=produced["k_all"], v_all_layer=produced["v_all"])
        if self.layer is not None and self.layer in tuple(m.svformer_anchors) and self.layer > 1:
            new["v_shared"] = produced["v"]
            new["v_all_shared"] = produced["v_all"]
        return new, produced


class ScannedBlock(nn.Module):
    """DecoderBlock in scan form: (carry, per-layer lambdas) -> (carry, None)."""
    cfg: Any
    decode: bool = False
    capture: bool = False

    @nn.compact
    def __call__(self, carry, ctx, lam_2):
        new, _ = DecoderBlock(self.cfg, None, self.decode, self.capture, name="block")(carry, ctx, lam_2)
        return new, None


class Transformer(nn.Module):
    """Token ids [B, T] -> fp32 logits [B, T, vocab]."""
    cfg: Any  # model ConfigDict
    decode: bool = False
    capture: bool = False
    max_len: int = 0  # decode cache length

    @nn.compact
    def __call__(self, tokens_BxT, positions_BxT=None, return_hidden: bool = False):
        """return_hidden: stop before the LM head and return RMSNorm(H_N) [B, T, E]
        (the training loss applies the head itself, a block at a time)."""
        m = self.cfg
        dtype = jnp.dtype(m.dtype)
        B, T = tokens_BxT.shape
        ctx = {}
        if self.decode:
            ctx["max_len"] = self.max_len
            index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
            ctx["index"] = index.value
            positions_BxT = jnp.broadcast_to(index.value + jnp.arange(T)[None], (B, T))
            if not self.is_initializing():
                index.value = index.value + T
        elif positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
        ctx["positions"] = positions_BxT

        h_BxTxE = Embed(m.vocab_size, m.d_model, m.init_std, dtype, name="embed")(tokens_BxT)
        lams_Nx2 = jnp.asarray(layer_lambdas(m))
        if m.value_residual in ("resformer", "resformer+neutreno") and m.resformer_lambdas == "learnable_plus":
            n = m.num_layers - 1
            logits_N = self.param("lambda_logits", nn.with_logical_partitioning(nn.initializers.zeros, ("layers",)),
                                  (n,), jnp.float32)
            scale = self.param("lambda_scale", nn.with_logical_partitioning(
                nn.initializers.constant(float(m.num_layers)), ()), (), jnp.float32)
            lams_Nx2 = lams_Nx2.at[:, 0].set(scale * jax.nn.softmax(logits_N))

        block_cls = DecoderBlock
        if m.remat != "none" and not self.decode:
            block_cls = nn.remat(DecoderBlock, policy=REMAT_POLICIES[m.remat], static_argnums=())

        # Layer 1: a standard layer that produces V_1 (and Q_1, K_1).
        carry = {"h": h_BxTxE}
        carry, first = block_cls(m, 1, self.decode, self.capture, name="layer_1")(carry, ctx, lams_Nx2[0])
        ctx = dict(ctx, q=first["q"], k=first["k"], v=first["v"], k_all=first["k_all"], v_all=first["v_all"])
        if m.value_source == "previous":
            carry["v_prev"] = first["v"]
        if m.value_source == "mean_of_previous" or m.mapping == "identity":
            carry["v_sum"] = first["v"].astype(jnp.float32)
            carry["n_prev"] = jnp.ones((), jnp.float32)
        if m.cla_share_every > 1:
            carry.update(k_layer=first["k"], v_layer=first["v"], k_all_layer=first["k_all"],
                         v_all_layer=first["v_all"])

        why_unrolled = needs_unrolled(m)
        if m.scan_layers and why_unrolled is None:
            scan = nn.scan(
                nn.remat(ScannedBlock, policy=REMAT_POLICIES[m.remat], prevent_cse=False)
                if m.remat != "none" and not self.decode else ScannedBlock,
                variable_axes={"params": 0, "cache": 0, "intermediates": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, 0),
                length=m.num_layers - 1,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            carry, _ = scan(m, self.decode, self.capture, name="layers")(carry, ctx, lams_Nx2)
        else:
            if m.scan_layers and why_unrolled:
                log.warning("scan_layers=True but %s; running the layers unrolled.", why_unrolled)
            outputs = [h_BxTxE, carry["h"]]  # DenseFormer: embedding output and every block output
            if m.denseformer:
                carry["h"] = DenseFormerAverage(2, name="dwa_1")(outputs)
            for n in range(2, m.num_layers + 1):
                carry, _ = block_cls(m, n, self.decode, self.capture, name=f"layer_{n}")(
                    carry, ctx, lams_Nx2[n - 2])
                if m.denseformer:
                    outputs.append(carry["h"])
                    carry["h"] = DenseFormerAverage(len(outputs), name=f"dwa_{n}")(outputs)
        h_BxTxE = carry["h"]

        h_BxTxE = RMSNorm(m.norm_eps, dtype, name="final_norm")(h_BxTxE)
        if return_hidden:
            return h_BxTxE
        logits_BxTxV = DenseGeneral((m.vocab_size,), ("embed", "vocab"), std=m.init_std, dtype=dtype,
                                    out_dtype=jnp.float32, name="lm_head")(h_BxTxE)
        return logits_BxTxV


class DenseFormerAverage(nn.Module):
    """Depth-weighted average over [H_0, ..., H_i], init one-hot on H_i (Pagliardini et al. 2024)."""
    n: int

    @nn.compact
    def __call__(self, outputs):
        init = np.zeros(self.n, np.float32)
        init[-1] = 1.0
        alpha = self.param("alpha", nn.with_logical_partitioning(lambda *_: jnp.asarray(init), ("layers",)),
                           (self.n,))
        return sum(alpha[i].astype(o.dtype) * o for i, o in enumerate(outputs))


def param_shapes(m):
    """Parameter shapes without allocating them (jax.eval_shape)."""
    model = Transformer(m)
    T = min(8, m.max_seq_len)
    variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, T), jnp.int32)))
    return nn.unbox(variables["params"])


def param_counts(m) -> dict:
    shapes = param_shapes(m)
    total = int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)))
    embed = int(np.prod(shapes["embed"]["embedding"].shape) + np.prod(shapes["lm_head"]["kernel"].shape))
    return {"params_total": total, "params_non_embedding": total - embed}


def flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token: 3x the forward (forward + backward), matmuls only.

    Forward: 2 FLOPs per multiply-add of every weight matrix a token passes
    through (all projections, the MLP and the LM head; the input embedding is
    a lookup), plus attention's QK^T and AV, 2*2*T*H*D per token per layer,
    counted at half for the causal mask. Eq. 2 (cross_layer) attends over
    twice the keys in layers >= 2.
    """
    shapes = param_shapes(m)
    matmul = 0
    for path, x in jax.tree_util.tree_leaves_with_path(shapes):
        if getattr(path[-1], "key", None) == "kernel":
            matmul += int(np.prod(x.shape))
    H, D = m.num_heads, m.d_model // m.num_heads
    attn_layers = m.num_layers + (m.num_layers - 1 if m.mapping == "cross_layer" else 0)
    attn = attn_layers * 2 * 2 * seq_len * H * D * 0.5
    return 3.0 * (2.0 * matmul + attn)
