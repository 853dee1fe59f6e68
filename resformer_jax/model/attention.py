"""Attention with value-residual mixing (paper Sec. 3) and a KV cache.

Layer n projects Q_n, K_n, V_n from its normed input. Layer 1 is standard and
its tensors are handed to every later layer (`first`). For n >= 2 the layer
attends with its own A_n over a mix of values:

  none        U_n = A_n V_n                                    (Eq. 1)
  resformer   U_n = A_n (l1 V_1 + l2 V_n)                      (Eq. 7, l1=l2=1/2)
  svformer    U_n = A_n V_1                                    (Eq. 10)
  neutreno    U_n = A_n V_n + lam (V_1 - V_n)                  (Eq. 8)

Values stay in key/value-head layout [B, T, K, D] (before GQA repetition) and
are never rotated. In decode mode each layer keeps only what its equation
needs: K for every layer, V only where the layer owns values (SVFormer: once).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from resformer_jax import kernels
from resformer_jax.config import head_dim, neutreno_lambda, num_kv_heads
from resformer_jax.model.layers import DenseGeneral, rope


def repeat_kv(x_BxTxKxD, num_heads):
    """[B, T, K, D] -> [B, T, H, D] by repeating each kv head H/K times."""
    K = x_BxTxKxD.shape[2]
    return jnp.repeat(x_BxTxKxD, num_heads // K, axis=2)


class Attention(nn.Module):
    cfg: Any  # model ConfigDict
    layer: int | None  # 1-based; None inside the scan (a generic layer >= 2)
    decode: bool = False
    capture: bool = False  # sow attention probabilities and values for analysis

    def _layer_is(self, fn) -> bool:
        return self.layer is not None and fn(self.layer)

    @nn.compact
    def __call__(self, x_BxTxE, ctx, carry, lam_2):
        """Returns (out_BxTxE, produced) where produced holds this layer's q/k/v.

        ctx: dict of first-layer tensors (`q`, `k`, `v`, and full-length `k_all`,
        `v_all` in decode mode), `positions` [B, T], `index` (decode position).
        carry: per-layer state threaded through the stack (previous values, CLA).
        lam_2: (l1, l2) for this layer, already resolved by the stack.
        """
        m = self.cfg
        dtype = jnp.dtype(m.dtype)
        H, K, D = m.num_heads, num_kv_heads(m), head_dim(m)
        mode = m.value_residual
        is_first = self.layer == 1
        resformer = mode in ("resformer", "resformer+neutreno")
        svformer = mode == "svformer"
        anchor = self._layer_is(lambda n: n in tuple(m.svformer_anchors))
        dense = lambda shape, axes, name, in_dims=1: DenseGeneral(  # noqa: E731
            shape, axes, in_dims=in_dims, std=m.init_std, dtype=dtype, name=name)
        # CLA: inside a group of `cla_share_every` layers, all but the first reuse K/V.
        cla_reuse = m.cla_share_every > 1 and self._layer_is(lambda n: (n - 1) % m.cla_share_every != 0)
        reuse_k = cla_reuse and m.cla_share in ("kv", "k")
        reuse_v = cla_reuse and m.cla_share in ("kv", "v")
        share_first = svformer and not is_first and not anchor  # layer takes something from layer 1
        l1, l2 = lam_2[0], lam_2[1]

        # Projections (a layer without a projection has no parameter for it).
        if share_first and m.svformer_share == "q":
            q_BxTxHxD = ctx["q"]
        else:
            q_BxTxHxD = dense((H, D), ("embed", "q_heads", "head_dim"), "query")(x_BxTxE)
        if reuse_k:
            k_BxTxKxD = carry["k_layer"]
        elif share_first and m.svformer_share == "k":
            k_BxTxKxD = ctx["k"]
        else:
            k_BxTxKxD = dense((K, D), ("embed", "kv_heads", "head_dim"), "key")(x_BxTxE)
        if reuse_v:
            v_BxTxKxD = carry["v_layer"]
        elif share_first and m.svformer_share == "v":
            v_BxTxKxD = None  # Eq. 10: no W_V at all in layers >= 2
        else:
            v_BxTxKxD = dense((K, D), ("embed", "kv_heads", "head_dim"), "value")(x_BxTxE)

        # The earlier value the residual uses (Fig. 8): V_1, V_{n-1} or their mean.
        v_src = None
        if not is_first:
            if m.value_source == "previous":
                v_src = carry["v_prev"]
            elif m.value_source == "mean_of_previous":
                v_src = (carry["v_sum"] / carry["n_prev"]).astype(dtype)
            else:
                v_src = ctx["v"]

        # Residual on queries or keys instead of values (Fig. 6 ablation).
        if resformer and not is_first and m.residual_on == "q":
            q_BxTxHxD = (l1 * ctx["q"] + l2 * q_BxTxHxD).astype(dtype)
        if resformer and not is_first and m.residual_on == "k":
            k_BxTxKxD = (l1 * ctx["k"] + l2 * k_BxTxKxD).astype(dtype)

        # The values this layer's attention matrix is applied to.
        if is_first or mode in ("none", "neutreno") or m.mapping != "attention" or m.residual_on != "v":
            v_att_BxTxKxD = v_BxTxKxD
        elif resformer:
            v_att_BxTxKxD = (l1 * v_src + l2 * v_BxTxKxD).astype(dtype)  # Eq. 7
        elif share_first and m.svformer_share == "v":
            v_att_BxTxKxD = carry.get("v_shared", ctx["v"])  # Eq. 10: A_n V_1
        else:
            v_att_BxTxKxD = v_BxTxKxD  # SVFormer anchor layer, or sharing Q/K instead (Fig. 13)

        positions_BxT = ctx["positions"]
        qr_BxTxHxD = rope(q_BxTxHxD, positions_BxT, m.rope_theta)
        kr_BxTxKxD = rope(k_BxTxKxD, positions_BxT, m.rope_theta)

        # Decode: write this step's K and attended V into the layer's own cache
        # and attend over the whole cache. A layer that owns no V (SVFormer
        # n >= 2, CLA reuse) reads the full-length V of the layer that owns it.
        owns_v = not (share_first and m.svformer_share == "v") and not reuse_v
        owns_k = not reuse_k and not (share_first and m.svformer_share == "k")
        if self.decode:
            k_all, v_all = self._cache(kr_BxTxKxD, v_att_BxTxKxD, owns_k, owns_v, ctx, carry)
            S = k_all.shape[1]
            q_pos_BxT = positions_BxT
            mask_BxTxS = jnp.arange(S)[None, None, :] <= q_pos_BxT[:, :, None]
            u_BxTxHxD, probs = kernels.reference_attention(qr_BxTxHxD, k_all, v_all, mask_BxTxS=mask_BxTxS,
                                                           return_probs=True)
        else:
            k_all, v_all = kr_BxTxKxD, v_att_BxTxKxD
            probs = None
            if m.mapping == "cross_layer" and not is_first:
                u_BxTxHxD = self._cross_layer(qr_BxTxHxD, kr_BxTxKxD, v_BxTxKxD, ctx)
            elif self.capture:
                u_BxTxHxD, probs = kernels.reference_attention(qr_BxTxHxD, kr_BxTxKxD, v_att_BxTxKxD,
                                                               return_probs=True)
            else:
                u_BxTxHxD = kernels.attention(qr_BxTxHxD, kr_BxTxKxD, v_att_BxTxKxD, causal=True,
                                              impl=m.attention_impl)
        if self.capture and probs is not None:
            self.sow("intermediates", "attn_probs", probs.mean(axis=1))  # [B, T, S] averaged over heads
            self.sow("intermediates", "values", v_att_BxTxKxD)

        if not is_first and m.mapping == "identity":
            u_BxTxHxD = u_BxTxHxD + repeat_kv(v_src, H).astype(u_BxTxHxD.dtype)  # Eq. 6
        if not is_first and mode in ("neutreno", "resformer+neutreno"):
            lam = neutreno_lambda(m)  # Eq. 8: (A - lam J) V_n + lam V_1, J V_n realised as the rows' V
            u_BxTxHxD = u_BxTxHxD + lam * repeat_kv(ctx["v"] - v_att_BxTxKxD, H).astype(u_BxTxHxD.dtype)

        out_BxTxE = DenseGeneral((x_BxTxE.shape[-1],), ("q_heads", "head_dim", "embed"), in_dims=2,
                                 std=m.init_std, dtype=dtype, name="out")(u_BxTxHxD.astype(dtype))
        produced = {"q": q_BxTxHxD, "k": k_BxTxKxD, "v": v_BxTxKxD, "v_att": v_att_BxTxKxD,
                    "k_all": k_all, "v_all": v_all}
        return out_BxTxE, produced

    def _cache(self, k_cur, v_cur, owns_k, owns_v, ctx, carry):
        """Preallocated [B, max_len, K, D] caches updated in place at ctx['index']."""
        m = self.cfg
        B = k_cur.shape[0]
        K, D = num_kv_heads(m), head_dim(m)
        shape = (B, ctx["max_len"], K, D)
        idx = ctx["index"]
        dtype = jnp.dtype(m.dtype)
        if owns_k:
            ck = self.variable("cache", "k", jnp.zeros, shape, dtype)
            if not self.is_initializing():
                ck.value = jax.lax.dynamic_update_slice(ck.value, k_cur.astype(dtype), (0, idx, 0, 0))
            k_all = ck.value
        elif "k_all_layer" in carry and carry["k_all_layer"] is not None and self.cfg.cla_share_every > 1:
            k_all = carry["k_all_layer"]
        else:
            k_all = ctx["k_all"]
        if owns_v:
            cv = self.variable("cache", "v", jnp.zeros, shape, dtype)
            if not self.is_initializing():
                cv.value = jax.lax.dynamic_update_slice(cv.value, v_cur.astype(dtype), (0, idx, 0, 0))
            v_all = cv.value
        elif self.cfg.cla_share_every > 1 and carry.get("v_all_layer") is not None:
            v_all = carry["v_all_layer"]
        else:
            v_all = carry.get("v_all_shared", ctx["v_all"])
        return k_all, v_all

    def _cross_layer(self, qr, kr, v, ctx):
        """Eq. 2: softmax(Q_n [K_n; K_m]^T) [V_n; V_m], causal within each half."""
        m = self.cfg
        k1r = rope(ctx["k"], ctx["positions"], m.rope_theta)
        T = qr.shape[1]
        causal_TxT = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
        mask_1xTx2T = jnp.concatenate([causal_TxT, causal_TxT], axis=1)[None]
        return kernels.reference_attention(qr, jnp.concatenate([kr, k1r], axis=1),
                                           jnp.concatenate([v, ctx["v"]], axis=1), mask_BxTxS=mask_1xTx2T)
