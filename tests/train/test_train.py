"""Optimizer, schedule, accumulation, the loop and its TensorBoard logs."""

import glob
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from resformer_jax.commands.training import run
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig
from resformer_jax.optimizer import lr_schedule, make_optimizer
from resformer_jax.presets import tiny_config
from resformer_jax.resolve import for_backend
from resformer_jax.train.step import init_state, make_train_step


def test_schedule_matches_paper():
    t = tiny_config().train
    t.steps, t.warmup_steps, t.peak_lr, t.init_lr, t.final_lr_ratio = 10000, 120, 6e-4, 1e-7, 0.1
    s = lr_schedule(t)
    assert float(s(0)) == pytest.approx(1e-7, rel=1e-6)
    assert float(s(60)) == pytest.approx(1e-7 + (6e-4 - 1e-7) / 2, rel=1e-5)  # linear warmup
    assert float(s(120)) == pytest.approx(6e-4, rel=1e-6)
    assert float(s(10000)) == pytest.approx(6e-5, rel=1e-5)
    mid = 120 + (10000 - 120) // 2
    assert float(s(mid)) == pytest.approx(6e-5 + 0.5 * (6e-4 - 6e-5), rel=1e-3)  # cosine midpoint


@pytest.mark.slow  # an optimizer step over every parameter kind: 5 s cold on 2 cores
def test_weight_decay_skips_norms_and_mixing_scalars():
    c = tiny_config("resformer")
    c.model.resformer_lambdas = "learnable"
    c.model.scan_layers = False
    model = Transformer(for_backend(ModelConfig.of(c.model)))
    tx = make_optimizer(c.train)
    state = init_state(model, tx, jax.random.PRNGKey(0), 8)  # op by op: reference.init_params
    params = nn.unbox(state.params)
    opt = tx.init(params)
    # Several steps with zero gradients: only weight decay moves parameters.
    zero = jax.tree.map(jnp.zeros_like, params)
    p = params
    for _ in range(5):
        upd, opt = tx.update(zero, opt, p)
        p = optax.apply_updates(p, upd)
    np.testing.assert_array_equal(p["layer_2"]["lambda1"], params["layer_2"]["lambda1"])
    np.testing.assert_array_equal(p["layer_1"]["attn_norm"]["scale"], params["layer_1"]["attn_norm"]["scale"])
    np.testing.assert_array_equal(p["final_norm"]["scale"], params["final_norm"]["scale"])
    assert np.abs(p["layer_1"]["mlp"]["up"]["kernel"]).sum() < np.abs(params["layer_1"]["mlp"]["up"]["kernel"]).sum()
    assert np.abs(p["embed"]["embedding"]).sum() < np.abs(params["embed"]["embedding"]).sum()


@pytest.mark.slow  # over 12 s in the fast tier
@pytest.mark.parametrize("mode", ["resformer", "svformer"])
def test_accumulation_equals_big_batch(mode):
    c = tiny_config(mode)
    model = Transformer(for_backend(ModelConfig.of(c.model)))
    tx = make_optimizer(c.train)
    state = nn.unbox(init_state(model, tx, jax.random.PRNGKey(0), 16))  # op by op: reference.init_params
    tokens = jax.random.randint(jax.random.PRNGKey(3), (8, 17), 0, c.model.vocab_size)
    s1, m1 = jax.jit(make_train_step(model, tx, 1))(state, tokens)
    s4, m4 = jax.jit(make_train_step(model, tx, 4))(state, tokens)
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), s1.params, s4.params)


@pytest.mark.parametrize("chunk_len", [1, 5, 16, 64])
def test_fused_chunked_cross_entropy_equals_full_logits(chunk_len):
    """The fused LM head + CE (train/loss.py) against CE on the full logits: the loss and the
    gradients of the hidden states and of the head, including a ragged last block (16 % 5)."""
    from resformer_jax.train.loss import chunked_cross_entropy, cross_entropy

    ks = jax.random.split(jax.random.PRNGKey(chunk_len), 3)
    h = jax.random.normal(ks[0], (3, 16, 24))
    w = jax.random.normal(ks[1], (24, 97)) * 0.3
    t = jax.random.randint(ks[2], (3, 16), 0, 97)

    def full(h, w):
        return cross_entropy(jnp.einsum("bte,ev->btv", h, w), t)

    def fused(h, w):
        return chunked_cross_entropy(h, w, t, chunk_len)

    want_l, want_g = jax.value_and_grad(full, argnums=(0, 1))(h, w)
    got_l, got_g = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(h, w)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(fused)(h, w), want_l, rtol=1e-6)  # the forward-only path (eval)
    for g, wg in zip(got_g, want_g):
        np.testing.assert_allclose(g, wg, rtol=1e-5, atol=1e-7)


def test_accelerator_head_pads_the_vocabulary_and_writes_compute_dtype_logits():
    """The accelerators' head plan (train/loss.py): W padded to 128 columns whose logits are masked (the loss and
    gradients of the unpadded head), and the logits GEMM writing bf16 for bf16 inputs (the CE of the bf16-rounded
    logits, in fp32)."""
    from resformer_jax.train.loss import ACCELERATOR_HEAD, HeadPlan, chunked_cross_entropy, cross_entropy

    ks = jax.random.split(jax.random.PRNGKey(7), 3)
    h = jax.random.normal(ks[0], (3, 16, 24))
    w = jax.random.normal(ks[1], (24, 97)) * 0.3
    t = jax.random.randint(ks[2], (3, 16), 0, 97)
    fused = lambda plan: jax.jit(jax.value_and_grad(lambda h, w: chunked_cross_entropy(h, w, t, 5, plan), (0, 1)))
    want_l, want_g = fused(HeadPlan())(h, w)
    got_l, got_g = fused(HeadPlan(vocab_multiple=128))(h, w)  # padding alone, fp32 logits
    np.testing.assert_allclose(got_l, want_l, rtol=1e-6)
    for g, wg in zip(got_g, want_g):
        assert g.shape == wg.shape
        np.testing.assert_allclose(g, wg, rtol=1e-5, atol=1e-7)

    hb = h.astype(jnp.bfloat16)
    ref = lambda h, w: cross_entropy(jnp.dot(h, w.astype(h.dtype), preferred_element_type=h.dtype), t)
    want_l, want_g = jax.value_and_grad(ref, (0, 1))(hb, w)
    got_l, got_g = fused(ACCELERATOR_HEAD)(hb, w)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    for g, wg in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(wg, np.float32), rtol=3e-2, atol=2e-3)
    jaxpr = str(jax.make_jaxpr(lambda h, w: chunked_cross_entropy(h, w, t, 5, ACCELERATOR_HEAD))(hb, w))
    assert "bf16[3,5,128]" in jaxpr or "bf16[15,128]" in jaxpr, "the logits GEMM writes bf16 over 128 columns"


def test_online_logsumexp_is_logsumexp_in_one_reduction():
    """The accelerators' head takes log Z in one read of the logits: the same value as jax.nn.logsumexp (masked
    -inf columns, a row of only -inf, large logits), from a single reduction over the vocabulary."""
    from resformer_jax.train.loss import online_logsumexp

    x = jax.random.normal(jax.random.PRNGKey(3), (4, 9, 1000)) * 30.0
    x = x.at[..., 900:].set(-jnp.inf).at[0, 0].set(-jnp.inf)
    got, want = online_logsumexp(x), jax.nn.logsumexp(x, axis=-1)
    assert got[0, 0] == -jnp.inf
    np.testing.assert_allclose(got[1:], want[1:], rtol=1e-6)
    assert str(jax.make_jaxpr(online_logsumexp)(x)).count("reduce") == 1


@pytest.mark.slow  # over 12 s in the fast tier
def test_train_step_same_with_fused_and_full_logits_loss():
    c = tiny_config("svformer")
    model = Transformer(for_backend(ModelConfig.of(c.model)))
    tx = make_optimizer(c.train)
    state = nn.unbox(init_state(model, tx, jax.random.PRNGKey(0), 16))  # op by op: reference.init_params
    tokens = jax.random.randint(jax.random.PRNGKey(3), (8, 17), 0, c.model.vocab_size)
    s0, m0 = jax.jit(make_train_step(model, tx, 1, loss_chunk_len=0))(state, tokens)
    s5, m5 = jax.jit(make_train_step(model, tx, 1, loss_chunk_len=5))(state, tokens)
    np.testing.assert_allclose(m5["loss"], m0["loss"], rtol=1e-6)
    np.testing.assert_allclose(m5["grad_norm"], m0["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), s5.params, s0.params)


def read_scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(logdir)
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}, ea


@pytest.mark.slow
def test_tiny_model_trains_on_real_text_and_logs_tensorboard(tmp_path, capsys):
    c = tiny_config("resformer")
    c.data.source = "demo"  # the Python standard library's source, prepared offline
    c.model.vocab_size = 1024
    c.data.seq_len = 64
    c.train.steps = 40
    c.train.global_batch = 8
    c.train.log_every = 10
    c.train.eval_every = 20
    c.train.eval_batches = 2
    c.checkpoint.every_steps = 100
    assert run(c, str(tmp_path)) == 0
    scalars, ea = read_scalars(str(tmp_path / "tb"))
    for tag in (
        "train/loss",
        "train/learning_rate",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/step_time_s",
        "perf/mfu_6n",
        "perf/mfu_model",
        "eval/loss",
        "eval/PythonStdlib/loss",
    ):
        assert tag in scalars, f"missing TensorBoard scalar {tag}"
    losses = [v for _, v in scalars["train/loss"]]
    assert losses[-1] < losses[0] - 0.5, losses
    evals = [v for _, v in scalars["eval/loss"]]
    assert evals[-1] < evals[0] - 0.5, evals
    assert "config" in "".join(ea.Tags().get("tensors", [])), "the resolved config is logged as text"
    out = capsys.readouterr().out
    assert "tok/s" in out and "ETA" in out
    assert len([ln for ln in out.splitlines() if ln.startswith("step ") and "/40" in ln]) == 4, (
        "progress prints once per log interval, not once per step"
    )


@pytest.mark.slow  # over 12 s in the fast tier
def test_nonfinite_loss_stops_with_step(tmp_path, capsys):
    c = tiny_config("none")
    c.train.peak_lr = 1e30  # diverges within a few steps
    c.train.warmup_steps = 0
    c.train.steps = 30
    c.train.log_every = 1
    code = run(c, str(tmp_path))
    err = capsys.readouterr().err
    assert code == 3
    assert "non-finite at step" in err and "skip_nonfinite_steps" in err


@pytest.mark.slow  # over 12 s in the fast tier
def test_skip_nonfinite_steps_counts_them(tmp_path):
    c = tiny_config("none")
    c.train.peak_lr = 1e30
    c.train.warmup_steps = 0
    c.train.steps = 10
    c.train.log_every = 5
    c.train.skip_nonfinite_steps = True
    assert run(c, str(tmp_path)) == 0
    scalars, _ = read_scalars(str(tmp_path / "tb"))
    assert scalars["train/nonfinite_steps"][-1][1] > 0
    assert glob.glob(os.path.join(str(tmp_path), "checkpoints", "10"))
