"""Optimizer, schedule, accumulation, the loop and its TensorBoard logs (issue 3)."""
import glob
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from resformer_jax.config import tiny_config
from resformer_jax.model import Transformer
from resformer_jax.train.loop import run
from resformer_jax.train.optimizer import lr_schedule, make_optimizer
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


def test_weight_decay_skips_norms_and_mixing_scalars():
    c = tiny_config("resformer")
    c.model.resformer_lambdas = "learnable"
    c.model.scan_layers = False
    model = Transformer(c.model)
    tx = make_optimizer(c.train)
    state = jax.jit(lambda r: init_state(model, tx, r, 8))(jax.random.PRNGKey(0))
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


@pytest.mark.parametrize("mode", ["resformer", "svformer"])
def test_accumulation_equals_big_batch(mode):
    c = tiny_config(mode)
    model = Transformer(c.model)
    tx = make_optimizer(c.train)
    state = nn.unbox(jax.jit(lambda r: init_state(model, tx, r, 16))(jax.random.PRNGKey(0)))
    tokens = jax.random.randint(jax.random.PRNGKey(3), (8, 17), 0, c.model.vocab_size)
    s1, m1 = jax.jit(make_train_step(model, tx, 1))(state, tokens)
    s4, m4 = jax.jit(make_train_step(model, tx, 4))(state, tokens)
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), s1.params, s4.params)


def read_scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(logdir)
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}, ea


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
    for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s",
                "perf/mfu_6n", "perf/mfu_model", "eval/loss", "eval/PythonStdlib/loss"):
        assert tag in scalars, f"missing TensorBoard scalar {tag}"
    losses = [v for _, v in scalars["train/loss"]]
    assert losses[-1] < losses[0] - 0.5, losses
    evals = [v for _, v in scalars["eval/loss"]]
    assert evals[-1] < evals[0] - 0.5, evals
    assert "config" in "".join(ea.Tags().get("tensors", [])), "the resolved config is logged as text"
    out = capsys.readouterr().out
    assert "tok/s" in out and "ETA" in out
    assert len([ln for ln in out.splitlines() if ln.startswith("step ") and "/40" in ln]) == 4, \
        "progress prints once per log interval, not once per step"


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
