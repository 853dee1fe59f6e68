"""Context parallelism (mesh.context): each sequence split over devices, keys and values gathered over the axis.
The partitioned program must be the whole sequence's program: logits and gradients equal to one device's, for
every value-residual variant, with data and fsdp axes beside it and with packed documents; SVFormer's V_1
crosses the axis once, not once a layer."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiers import fast_few

from resformer_jax.config import ConfigError, RunConfig, validate
from resformer_jax.parallel.mesh import MeshError, make_mesh
from resformer_jax.presets import tiny_config
from resformer_jax.resolve import resolve
from resformer_jax.train.setup import build

VARIANTS = ("none", "resformer", "svformer", "skipv1")


def config(variant, context, data=-1, fsdp=1, documents=False, num_devices=0, impl="xla", norm="auto"):
    c = tiny_config(variant)
    c.model.attention_impl = impl
    c.model.norm_impl = norm
    c.model.num_kv_heads = 2
    c.model.scan_layers = False
    c.data.seq_len = 32
    c.train.global_batch = 4
    c.mesh.data, c.mesh.fsdp, c.mesh.context, c.mesh.num_devices = data, fsdp, context, num_devices
    if documents:
        c.data.document_mask = True
        c.data.eot_id = 0
    return c


def loss_and_grads(c, tokens):
    setup = build(resolve(c, log=lambda m: None))
    state = setup.init_state(seed=0)
    params = state.params
    model = setup.model

    def loss(p, t):
        logits = model.apply({"params": p}, t[:, :-1]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), t[:, 1:, None], -1))

    tokens = jax.device_put(tokens, setup.batch_sh)
    value, grads = jax.jit(jax.value_and_grad(loss))(params, tokens)
    return float(value), jax.tree.map(np.asarray, grads), setup


@functools.cache
def one_device(variant, documents=False):
    """(tokens, loss, gradients) of `variant` on one device: the reference every mesh of the variant is held to,
    computed once a process (a compile each)."""
    one = config(variant, 1, data=1, fsdp=1, num_devices=1, documents=documents)
    t = tokens_for(one, documents=documents)
    loss1, grads1, _ = loss_and_grads(one, t)
    return t, loss1, grads1


def tokens_for(c, documents=False):
    rng = np.random.default_rng(0)
    t = rng.integers(1, c.model.vocab_size, (c.train.global_batch, c.data.seq_len + 1)).astype(np.int32)
    if documents:
        t[:, [5, 14, 20]] = 0  # end-of-text tokens: four documents a row
    return t


@pytest.mark.slow  # a compile a mesh and variant: minutes together
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "mesh",
    [
        dict(context=2, data=2, fsdp=2),
        dict(context=4, data=2, fsdp=1),
        dict(context=8, data=1, fsdp=1),
        dict(context=4, data=2, impl="pallas", norm="pallas"),  # the norm kernels on each device's tokens too
    ],
    ids=["xla-data2-fsdp2-context2", "xla-data2-context4", "xla-context8", "pallas-data2-context4"],
)
def test_a_sequence_split_over_devices_gives_one_devices_loss_and_gradients(variant, mesh):
    """The balanced layout (each device two slices of the sequence, one from each end) included: the logits come
    back in the sequence's order, every query attends by its position."""
    assert len(jax.devices()) == 8
    t, loss1, grads1 = one_device(variant)
    loss_n, grads_n, setup = loss_and_grads(config(variant, **mesh), t)
    want = {"data": mesh.get("data", 2), "context": mesh["context"]}
    assert dict(setup.mesh.shape) == {**want, "fsdp": mesh.get("fsdp", 8 // want["data"] // mesh["context"])}
    assert abs(loss_n - loss1) < 1e-5, (loss_n, loss1)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_n), jax.tree.leaves(grads1)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # a compile a mesh and variant: minutes together
@pytest.mark.parametrize(
    "variant,impl", [("resformer", "xla"), ("svformer", "xla"), ("svformer", "pallas"), ("resformer", "splash")]
)
def test_packed_documents_split_over_devices_match_one_device(variant, impl):
    t, loss1, grads1 = one_device(variant, documents=True)
    context, data = (8, 1) if impl == "xla" and variant == "svformer" else (4, 2)  # context 8 once, with documents
    loss_n, grads_n, setup = loss_and_grads(config(variant, context, data=data, documents=True, impl=impl), t)
    assert setup.model.cfg.document_eot == 0  # the documents are masked
    assert abs(loss_n - loss1) < 1e-5
    for a, b in zip(jax.tree.leaves(grads_n), jax.tree.leaves(grads1)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


@pytest.mark.slow  # a compile a mesh and variant: minutes together
def test_activations_are_split_and_svformer_gathers_v1_once():
    """In the compiled forward (layers unrolled, context 2, no fsdp: every all-gather but the last is attention's),
    vanilla gathers K and V in each of its L layers, SVFormer each layer's K and V_1 once; the hidden states stay
    split."""

    def gathers(variant):
        c = config(variant, 2, data=4)
        setup = build(resolve(c, log=lambda m: None))
        params = setup.init_state(seed=0).params
        tokens = jax.device_put(tokens_for(c)[:, :-1], setup.batch_sh)
        f = jax.jit(lambda p, t: setup.model.apply({"params": p}, t, return_hidden=True))
        h = f(params, tokens)
        assert h.sharding.is_equivalent_to(NamedSharding(setup.mesh, P(("data", "fsdp"), "context", None)), 3)
        hlo = f.lower(params, tokens).compile().as_text()
        return len(re.findall(r"= \S+ all-gather(?:-start)?\(", hlo)), c.model.num_layers

    vanilla, L = gathers("none")
    svformer, _ = gathers("svformer")
    # + 1: the last hidden states put back in the sequence's order (from the balanced layout)
    assert vanilla == 2 * L + 1, vanilla
    assert svformer == L + 1 + 1, svformer


def test_bad_context_settings_are_named():
    with pytest.raises(ConfigError, match=r"data.seq_len=32 does not split into 2 x 3 equal slices"):
        validate(config("svformer", 3))
    c = config("svformer", 2)
    c.model.attention_impl = "cudnn"
    with pytest.raises(
        ConfigError, match=r"'cudnn' does not run context-parallel.*use one of pallas, splash, xla, reference"
    ):
        validate(c)
    with pytest.raises(MeshError, match="mesh.context=3 does not divide the 8 devices"):
        make_mesh(config("svformer", 3).mesh)
    c = config("svformer", 2)
    c.model.attention_impl = "auto"
    logged = []
    assert resolve(c, log=logged.append).model.attention_impl == "xla"
    assert any("mesh.context=2" in m for m in logged)


@pytest.mark.slow
def test_a_context_parallel_run_trains_as_one_device_does_and_resumes_bitwise(tmp_path):
    """The trainer end to end (layers scanned, V_1 a broadcast input of the scan), mesh.context=4 beside data=2:
    over 20 steps the losses of one device to 1e-5; stopped at step 10 and resumed, bitwise those of the run
    that never stopped."""
    from tb_losses import losses

    from resformer_jax.commands.training import run

    def cfg(stop_at=0, **mesh):
        c = config("svformer", **mesh)
        c.model.scan_layers = True
        c.train.steps, c.train.log_every, c.train.eval_every, c.checkpoint.every_steps = 20, 1, 1000, 10
        c.train.stop_at = stop_at  # 10: the run stops there, its schedule still 20 steps long
        return c

    assert run(cfg(context=1, data=1, num_devices=1), str(tmp_path / "one")) == 0
    assert run(cfg(context=4, data=2), str(tmp_path / "cp")) == 0
    assert run(cfg(10, context=4, data=2), str(tmp_path / "resumed")) == 0
    assert run(cfg(context=4, data=2), str(tmp_path / "resumed")) == 0
    cp, one, resumed = (losses(str(tmp_path / d)) for d in ("cp", "one", "resumed"))
    assert len(cp) == len(resumed) == 20
    np.testing.assert_allclose(cp, one, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(resumed, cp)


def test_the_memory_estimate_counts_a_devices_slice_of_the_sequence():
    from resformer_jax.perf import estimate_train_memory

    c = config("svformer", 1, data=-1)
    c.data.seq_len, c.model.max_seq_len, c.train.global_batch = 4096, 4096, 8
    one = estimate_train_memory(RunConfig.of(c), 8)
    c.mesh.context, c.mesh.data = 4, 2
    split = estimate_train_memory(RunConfig.of(c), 8)
    # the same sequences a device (8 over data 2 x context 4: 4 a device), a quarter of each one's tokens
    assert split["per_device_micro_batch"] == 4 * one["per_device_micro_batch"]
    kv = 3 * 4 * 4096 * 2 * 2 * 16 * 4  # layers x sequences x tokens x (K and V) x kv heads x head_dim x fp32
    assert split["activations_kept"] == one["activations_kept"] + kv
    assert split["state"] == one["state"]
    c.mesh.context, c.mesh.data = 8, 1
    # every device holds an eighth of all 8 sequences: one sequence's worth
    whole = estimate_train_memory(RunConfig.of(c), 8)
    assert whole["activations_kept"] > one["activations_kept"]  # plus every layer's gathered keys and values
    assert whole["one_layer"] > one["one_layer"]


@pytest.mark.parametrize("documents", (False, True))
@pytest.mark.parametrize("block", (16, 32))
def test_the_pallas_kernel_attends_from_a_devices_slices_of_the_sequence(documents, block):
    """flash_attention_at (interpreted): queries at two slices of the sequence (a device's under the balanced
    layout) against every key in order equal softmax attention with the mask by position, outputs and gradients,
    GQA, a slice shorter than a block (the padding) included."""
    from resformer_jax.kernels import pallas_attention

    S, H, K, D = 96, 4, 2, 16
    positions = np.concatenate([np.arange(16, 40), np.arange(72, 84)])[None].repeat(2, 0)  # 36 queries
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, positions.shape[1], H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, S, K, D)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.cumsum(rng.random((2, S)) < 0.05, axis=1), jnp.int32) if documents else None

    def reference(q, k, v):
        kk, vv = jnp.repeat(k, H // K, 2), jnp.repeat(v, H // K, 2)
        s = jnp.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(D)
        mask = jnp.arange(S)[None, None, :] <= jnp.asarray(positions)[:, :, None]
        if documents:
            mask = mask & (jnp.take_along_axis(seg, jnp.asarray(positions), 1)[:, :, None] == seg[:, None, :])
        p = jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), axis=-1)
        return jnp.einsum("bhts,bshd->bthd", p, vv)

    def kernel(q, k, v):
        return pallas_attention.flash_attention_at(
            q, k, v, jnp.asarray(positions), segments_BxS=seg, block_q=block, block_k=block
        )

    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    want = jax.vjp(reference, q, k, v)
    got = jax.vjp(kernel, q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
    for g, w in zip(got[1](do), want[1](do)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("documents", fast_few([False, True], [False]))
def test_splash_attends_from_a_devices_slices_of_the_sequence(documents):
    """TPU splash under a context axis of 4 (interpreted), data 2 beside it: each device's queries (two slices, one
    from each end) against every key, its block tables cut over the axis, equal the whole sequence's attention,
    outputs and gradients, GQA, slices shorter than splash's 128-row tile (the padding) included."""
    from jax.sharding import Mesh

    from resformer_jax.kernels import attention as dispatch
    from resformer_jax.kernels.names import balanced_order

    mesh = Mesh(np.array(jax.devices()).reshape(2, 1, 4), ("data", "fsdp", "context"))
    B, T, H, K, D = 2, 64, 4, 2, 16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, D)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.1, axis=1), jnp.int32) if documents else None
    order = balanced_order(T, 4)

    def attend(impl):
        def f(q, k, v):  # the sequence laid out as the model lays it out, the output put back in order
            o = dispatch.attention(
                q[:, order],
                k[:, order],
                v[:, order],
                impl=impl,
                mesh=mesh,
                segments_BxT=None if seg is None else seg[:, order],
            )
            return o[:, np.argsort(order)]

        return f

    want = jax.vjp(attend("reference"), q, k, v)
    got = jax.vjp(jax.jit(attend("splash")), q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    for g, w in zip(got[1](do), want[1](do)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_tune_tries_the_context_axis_for_long_sequences():
    from resformer_jax.compilation.aot import tune_candidates

    c = config("svformer", 1)
    c.train.global_batch = 16
    assert {cand["mesh.context"] for cand in tune_candidates(c, 8)} == {1}  # 32 tokens: no reason to split
    c.data.seq_len = 32768
    cands = tune_candidates(c, 8)
    assert {cand["mesh.context"] for cand in cands} == {1, 2, 4, 8}
    # the largest microbatch of each: the whole batch over the devices that hold whole sequences, then halving
    for context in (1, 2, 4, 8):
        micro = sorted({x["train.microbatch"] for x in cands if x["mesh.context"] == context}, reverse=True)
        shards = 8 // context
        assert micro[0] == 16 and micro[-1] == shards and all(m % shards == 0 for m in micro)


def test_the_balanced_layout_gives_every_device_the_same_causal_work_and_the_roofline_counts_it():
    from resformer_jax.kernels.names import balanced_order
    from resformer_jax.kernels.pallas_attention import visited_blocks

    T, N, b = 8192, 8, 64
    order = balanced_order(T, N)
    per_device = []
    for r in range(N):
        mine = order[r * T // N : (r + 1) * T // N]
        assert (np.diff(mine) > 0).all()  # ascending: the kernel's block skipping relies on it
        per_device.append(sum(-(-(int(mine[i : i + b].max()) + 1) // b) for i in range(0, len(mine), b)))
    assert len(set(per_device)) == 1  # every device the same key blocks
    assert sorted(order.tolist()) == list(range(T))
    assert abs(visited_blocks(T // N, T, b, b) / per_device[0] - 1) < 0.01
