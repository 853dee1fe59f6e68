"""Per-layer telemetry: the norms of the gradient, the parameters and the applied update, per layer and per kind
(attention, MLP, norms, value-residual scalars; embeddings and the LM head on their own), computed inside the
train step from the parameter tree as it is (the scanned stack's leading `layers` axis read per layer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _kind_and_layer(names: list[str]) -> tuple[str, int | None, bool]:
    """(kind, 1-based layer or None, whether the leaf is the scanned stack over layers 2..N)."""
    stacked = bool(names) and names[0] == "layers"
    layer = None
    if names and names[0].startswith("layer_"):
        layer = int(names[0].split("_")[1])
    if any(n == "attn" for n in names):
        kind = "attn"
    elif any(n == "mlp" for n in names):
        kind = "mlp"
    elif any(n.endswith("_norm") for n in names):
        kind = "norm"
    elif any(n.startswith("lambda") for n in names):
        kind = "lambda"
    elif names and names[0] in ("embed", "pos_embed"):
        kind = "embed"
    elif names and names[0] == "lm_head":
        kind = "head"
    else:
        kind = "other"
    return kind, layer, stacked


def layer_norms(tree, num_layers: int) -> dict[str, jax.Array]:
    """{kind: [num_layers] L2 norms} for the kinds that live in layers, and {kind: scalar} for the others
    (embed, head, and anything outside a layer). A kind absent from the tree is left out."""
    sums: dict[str, jax.Array] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        names = [k.key for k in path if hasattr(k, "key")]
        kind, layer, stacked = _kind_and_layer(names)
        sq = jnp.square(x.astype(jnp.float32))
        if stacked:  # [layers 2..N, ...]: one sum per layer
            per_layer = jnp.sum(sq.reshape(sq.shape[0], -1), axis=1)
            vec = jnp.zeros((num_layers,), jnp.float32).at[1 : 1 + per_layer.shape[0]].set(per_layer)
        elif layer is not None:
            vec = jnp.zeros((num_layers,), jnp.float32).at[layer - 1].set(jnp.sum(sq))
        else:
            vec = jnp.sum(sq)
        key = kind if (stacked or layer is not None) else f"{kind}_total"
        sums[key] = sums.get(key, 0.0) + vec
    return {k: jnp.sqrt(v) for k, v in sums.items()}


def step_telemetry(grads, params, new_params, num_layers: int) -> dict[str, dict[str, jax.Array]]:
    """{what: layer_norms} for what in grad_norm, param_norm, update_norm (the update as applied)."""
    update = jax.tree.map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32), new_params, params)
    return {
        "grad_norm": layer_norms(grads, num_layers),
        "param_norm": layer_norms(new_params, num_layers),
        "update_norm": layer_norms(update, num_layers),
    }


def scalars(telemetry: dict) -> dict[str, float]:
    """The step's telemetry (on the host) as TensorBoard scalars: telemetry/{what}/{kind}/layer_NN, and
    telemetry/{what}/{kind} for the kinds outside the layers."""
    out = {}
    for what, kinds in telemetry.items():
        for kind, v in kinds.items():
            v = np.asarray(v)
            if v.ndim == 0:
                out[f"telemetry/{what}/{kind.removesuffix('_total')}"] = float(v)
                continue
            for i, x in enumerate(v):
                out[f"telemetry/{what}/{kind}/layer_{i + 1:02d}"] = float(x)
    return out
