"""FSDP as compiled: each device keeps its rows through every layer and gathers the weights, never the other way
round (the whole batch's activations with the embedding width split, partial sums all-reduced)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resformer_jax.presets import tiny_config
from resformer_jax.resolve import resolve
from resformer_jax.train.setup import build


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_fsdp_gathers_the_weights_and_keeps_each_devices_rows(scan):
    """data 1 x fsdp 8: the gradient's program all-gathers weights and all-reduces nothing the size of the batch's
    tokens. The embedding lookup inherits its table's fsdp-split width; unconstrained, layer 1 (and on this mesh
    every layer) ran on all 256 tokens with the width split and all-reduced [256, ffn] partial sums (the 3B
    SVFormer's step bound on v5p-128 was 6% over: docs/scaling-out.md)."""
    c = tiny_config("svformer")
    c.data.seq_len, c.train.global_batch = 32, 8
    c.mesh.data, c.mesh.fsdp = 1, 8
    c.model.d_model, c.model.ffn_dim, c.model.scan_layers = 64, 128, scan
    setup = build(resolve(c, log=lambda m: None))
    params = setup.init_state(seed=0).params
    tokens_BxT = jax.device_put(np.ones((8, 32), np.int32), setup.batch_sh)

    def loss(p, t):
        return setup.model.apply({"params": p}, t).astype(jnp.float32).mean()

    hlo = jax.jit(jax.grad(loss)).lower(params, tokens_BxT).compile().as_text()
    collectives = re.findall(r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather|reduce-scatter)(?:-start)?\(", hlo)
    tokens = 8 * 32
    whole_batch = [
        (kind, shape)
        for _, shape, kind in collectives
        if kind == "all-reduce" and shape and (int(shape.split(",")[0]) == tokens or shape.startswith("8,32"))
    ]
    assert not whole_batch, f"activations of the whole batch reduced across devices: {whole_batch}"
    gathered = {shape for _, shape, kind in collectives if kind == "all-gather"}
    assert {"64,128", "128,64"} <= gathered, f"the MLP's weights are not gathered (FSDP): {sorted(gathered)}"
