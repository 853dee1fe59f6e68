"""ResFormer's mixing weights (l1, l2) of Eq. 7, all in one place: created, resolved, read back.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from resformer_jax.model.config import ModelConfig


def fixed_lambdas(m: ModelConfig) -> np.ndarray:
    """(l1, l2) for layers 2..N as a [N-1, 2] array for the non-learnable settings
    (and the init of the learnable ones)."""
    n = m.num_layers - 1
    l1, l2 = (float(x) for x in m.lambda_init)
    if m.resformer_lambdas == "sparse":
        l1s = np.array([m.sparse_lambda if (i + 2) in tuple(m.sparse_layers) else 0.0 for i in range(n)], np.float32)
        return np.stack([l1s, np.ones(n, np.float32)], axis=1)
    return np.tile(np.array([[l1, l2]], np.float32), (n, 1))


def _scalar(module: nn.Module, name: str, value: float):
    return module.param(name, nn.with_logical_partitioning(nn.initializers.constant(value), ()), (), jnp.float32)


def stack_lambdas(module: nn.Module, m: ModelConfig):
    """[L-1, 2]: (l1, l2) of each layer >= 2; `learnable_plus` creates its stack-level parameters on `module`."""
    lams_Lx2 = jnp.asarray(fixed_lambdas(m))
    if m.mixes_values and m.resformer_lambdas == "learnable_plus":
        n = m.num_layers - 1
        logits_L = nn.unbox(
            module.param(
                "lambda_logits", nn.with_logical_partitioning(nn.initializers.zeros, ("layers",)), (n,), jnp.float32
            )
        )
        scale = _scalar(module, "lambda_scale", float(m.num_layers))
        lams_Lx2 = lams_Lx2.at[:, 0].set(scale * jax.nn.softmax(logits_L))
    return lams_Lx2


def block_lambdas(module: nn.Module, m: ModelConfig, layer: int | None, lam_2):
    """This layer's (l1, l2): the stack's row, or the block's own parameters (created on `module`)."""
    if not m.mixes_values or layer == 1:
        return lam_2
    if m.resformer_lambdas == "learnable":
        lam_2 = jnp.stack([_scalar(module, "lambda1", m.lambda_init[0]), _scalar(module, "lambda2", m.lambda_init[1])])
    elif m.resformer_lambdas == "convex":
        lam = _scalar(module, "lambda", m.lambda_init[0])
        lam_2 = jnp.stack([lam, 1.0 - lam])
    elif m.resformer_lambdas == "learnable_plus":
        lam_2 = jnp.stack([lam_2[0], _scalar(module, "lambda2", m.lambda_init[1])])
    module.sow("intermediates", "lambdas", lam_2)
    return lam_2


def gate_intermediates(model: nn.Module, params, tokens_BxT):
    """A forward of `model` that keeps each layer's mean learned value gate (model/attention.py sows it) and stops
    before the LM head; jit it once (gate_means reads the result)."""
    return model.apply({"params": params}, tokens_BxT, return_hidden=True, mutable=["intermediates"])[1]


def gate_means(state) -> dict[int, float]:
    """{layer: the mean of its learned value gate g over the batch's tokens and heads} from gate_intermediates'
    result (resformer_lambdas=gated; g = 0 is the layer's own value, 1 layer 1's)."""
    inter = jax.device_get(state).get("intermediates", {})
    out: dict[int, float] = {}
    if "layers" in inter:  # scanned: one value per layer along the leading axis
        for i, v in enumerate(np.asarray(jax.device_get(inter["layers"]["block"]["attn"]["gate_mean"][0]))):
            out[i + 2] = float(v)
    for name, sub in inter.items():
        if name.startswith("layer_") and "gate_mean" in sub.get("attn", {}):
            out[int(name.split("_")[1])] = float(jax.device_get(sub["attn"]["gate_mean"][0]))
    return out


def read_lambdas(params, m: ModelConfig) -> dict[int, dict[str, float]]:
    """{layer: {"lambda1": v, "lambda2": v}} of the learned weights in a parameter tree (empty if none)."""
    if not m.learns_lambdas:
        return {}
    layers: dict[int, dict[str, float]] = {}
    names = ("lambda1", "lambda2", "lambda")
    if "layers" in params:  # scanned blocks: one value per layer along the leading axis
        blk = jax.device_get(params["layers"]["block"])
        for name in names:
            for i, v in enumerate(np.asarray(blk.get(name, []))):
                layers.setdefault(i + 2, {})[name] = float(v)
    for n in range(2, m.num_layers + 1):
        for name in names:
            if name in params.get(f"layer_{n}", {}):
                layers.setdefault(n, {})[name] = float(jax.device_get(params[f"layer_{n}"][name]))
    for d in layers.values():  # convex: (l1, l2) = (lambda, 1 - lambda)
        if "lambda" in d:
            lam = d.pop("lambda")
            d["lambda1"], d["lambda2"] = lam, 1.0 - lam
    if "lambda_logits" in params:
        l1 = float(params["lambda_scale"]) * jax.nn.softmax(jax.device_get(params["lambda_logits"]))
        for i, v in enumerate(np.asarray(l1)):
            layers.setdefault(i + 2, {})["lambda1"] = float(v)
    return layers
