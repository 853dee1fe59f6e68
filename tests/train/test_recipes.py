"""Today's training recipes: Muon against a numpy transcription of its update, the WSD schedule against its formula
and a cooldown forked from a checkpoint, z-loss against numpy, loss-spike skipping, and their bad values."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from commands import run_command

from resformer_jax.commands.training import run
from resformer_jax.config import base_config
from resformer_jax.metrics import read_jsonl
from resformer_jax.optimizer import lr_schedule, make_optimizer, muon_dimensions
from resformer_jax.presets import tiny_config
from resformer_jax.train.loss import chunked_lm_loss, cross_entropy_and_z

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NS = (3.4445, -4.7750, 2.0315)  # optax's default Newton-Schulz coefficients


def train_section(**fields) -> ml_collections.ConfigDict:
    t = base_config().train
    for k, v in fields.items():
        t[k] = v
    return t


# ---------------------------------------------------------------------------------------------- Muon


def newton_schulz(g: np.ndarray, steps: int = 5, eps: float = 1e-8) -> np.ndarray:
    """Muon's orthogonalisation, written from the method: X = G / ||G||_F, transposed to be wide, then
    X <- a X + (b A + c A^2) X with A = X X^T."""
    x = g / (np.linalg.norm(g) + eps)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    a, b, c = NS
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x if wide else x.T


def muon_update(g: np.ndarray, param: np.ndarray, in_axes: int, lr: float, beta: float, wd: float) -> np.ndarray:
    """The first Muon update of a [*batch?, in..., out...] weight from zero momentum (Nesterov, bias-corrected as
    optax does: mu_1 = (1 - beta) g; mu_hat = beta mu_1 / (1 - beta^2) + (1 - beta) g / (1 - beta)), per matrix,
    scaled by sqrt(max(1, fan_out / fan_in)), plus decoupled weight decay, times -lr."""
    mu = (1 - beta) * g
    mu_hat = beta * mu / (1 - beta**2) + (1 - beta) * g / (1 - beta)
    fan_in = int(np.prod(g.shape[:in_axes]))
    m = mu_hat.reshape(fan_in, -1)
    o = newton_schulz(m).reshape(g.shape) * np.sqrt(max(1.0, m.shape[1] / fan_in))
    return -lr * (o + wd * param)


def test_muon_update_equals_its_transcription_per_layer_of_a_scanned_stack():
    rng = np.random.default_rng(0)
    params = {
        "layer_1": {"attn": {"query": {"kernel": rng.normal(size=(8, 2, 4))}}},  # [E, H, D]
        "layers": {"block": {"mlp": {"down": {"kernel": rng.normal(size=(3, 16, 8))}}}},  # [L, F, E], per layer
        "embed": {"embedding": rng.normal(size=(10, 8))},  # AdamW
        "final_norm": {"scale": np.ones(8)},  # AdamW
    }
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    t = train_section(optimizer="muon", schedule="constant", warmup_steps=0, grad_clip=1e9, weight_decay=0.1)
    dims = muon_dimensions(params)
    assert dims["embed"]["embedding"] is None and dims["final_norm"]["scale"] is None
    tx = make_optimizer(t)
    updates, _ = tx.update(grads, tx.init(params), params)
    q = np.asarray(grads["layer_1"]["attn"]["query"]["kernel"], np.float64)
    want_q = muon_update(q, np.asarray(params["layer_1"]["attn"]["query"]["kernel"]), 1, t.muon_lr, 0.95, 0.1)
    np.testing.assert_allclose(updates["layer_1"]["attn"]["query"]["kernel"], want_q, rtol=2e-4, atol=1e-6)
    d = np.asarray(grads["layers"]["block"]["mlp"]["down"]["kernel"], np.float64)
    p = np.asarray(params["layers"]["block"]["mlp"]["down"]["kernel"])
    for layer in range(3):  # each layer of the stack orthogonalised on its own
        want = muon_update(d[layer], p[layer], 1, t.muon_lr, 0.95, 0.1)
        np.testing.assert_allclose(
            updates["layers"]["block"]["mlp"]["down"]["kernel"][layer], want, rtol=2e-4, atol=1e-6
        )
    # AdamW's first step on the rest: -lr * (sign-like g / (|g| + eps) + wd * p) for the embedding
    g, p = np.asarray(grads["embed"]["embedding"]), np.asarray(params["embed"]["embedding"])
    want = -t.peak_lr * (g / (np.abs(g) + t.eps) + t.weight_decay * p)
    np.testing.assert_allclose(updates["embed"]["embedding"], want, rtol=1e-4, atol=1e-7)
    s = np.asarray(grads["final_norm"]["scale"])
    np.testing.assert_allclose(updates["final_norm"]["scale"], -t.peak_lr * s / (np.abs(s) + t.eps), rtol=1e-4)


def tiny(steps=8, **train):
    c = tiny_config("resformer")
    c.train.steps, c.train.log_every, c.train.eval_every = steps, 1, 1000
    c.checkpoint.every_steps, c.mesh.num_devices = 100, 1
    for k, v in train.items():
        c.train[k] = v
    return c


def losses(wd):
    return read_jsonl(os.path.join(wd, "metrics.jsonl"), "train/loss")


@pytest.mark.slow
def test_a_muon_run_learns_says_its_groups_and_resumes_bitwise(tmp_path, capsys):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert run(tiny(10, optimizer="muon"), straight) == 0
    out = capsys.readouterr().out
    assert "optimizer muon on " in out and "adamw on " in out, out
    ref = losses(straight)
    assert np.mean([ref[s] for s in (8, 9, 10)]) < np.mean([ref[s] for s in (1, 2, 3)]) - 0.15, ref
    assert run(tiny(10, optimizer="muon", stop_at=5), resumed) == 0
    assert run(tiny(10, optimizer="muon"), resumed) == 0
    got = losses(resumed)
    assert all(got[s] == ref[s] for s in range(6, 11)), (got, ref)


@pytest.mark.slow
def test_a_muon_run_killed_mid_flight_resumes_bitwise(tmp_path):
    ref_wd, wd = str(tmp_path / "ref"), str(tmp_path / "killed")
    flags = ["--config=configs/tiny.py", "--config.train.optimizer=muon", "--config.train.steps=12"]
    flags += ["--config.train.log_every=1", "--config.checkpoint.every_steps=3", "--config.mesh.num_devices=1"]
    flags += ["--config.train.eval_every=1000"]
    main = [sys.executable, "-m", "resformer_jax.main", *flags]
    assert run_command("train", *flags, f"--workdir={ref_wd}").returncode == 0  # in-process: compiled as a command
    p = subprocess.Popen([*main, f"--workdir={wd}"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    for line in p.stdout:
        if "step       8/" in line:
            break
        assert time.time() - t0 < 300
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert run_command("train", *flags, f"--workdir={wd}").returncode == 0
    ref, got = losses(ref_wd), losses(wd)
    assert all(got[s] == ref[s] for s in range(7, 13)), (got, ref)


# ---------------------------------------------------------------------------------------------- WSD


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_learning_rate_at_chosen_steps_is_its_formula(shape):
    t = train_section(schedule="wsd", steps=1000, wsd_fractions=(0.1, 0.6, 0.3), wsd_decay_shape=shape)
    t.peak_lr, t.init_lr, t.final_lr_ratio = 1e-3, 0.0, 0.1
    sched = lr_schedule(t)
    final = 1e-4
    for step, want in ((0, 0.0), (50, 5e-4), (100, 1e-3), (400, 1e-3), (699, 1e-3)):
        assert float(sched(step)) == pytest.approx(want, rel=1e-5, abs=1e-9), step
    for step in (700, 775, 850, 925, 1000):
        x = (step - 700) / 300
        frac = {"linear": 1 - x, "cosine": 0.5 * (1 + np.cos(np.pi * x)), "1-sqrt": 1 - np.sqrt(x)}[shape]
        assert float(sched(step)) == pytest.approx(final + (1e-3 - final) * frac, rel=1e-5), (shape, step)


@pytest.mark.slow
@pytest.mark.xla_emitters
def test_a_cooldown_forked_from_a_checkpoint_equals_a_run_that_switched_schedule_there(tmp_path):
    steps, k = 10, 5
    wsd = {"schedule": "wsd", "wsd_fractions": (0.2, 0.6, 0.2)}
    switched, stable, fork = (str(tmp_path / n) for n in ("switched", "stable", "fork"))
    assert run(tiny(steps, decay_start_step=k, **wsd), switched) == 0
    assert run(tiny(steps, decay_start_step=steps - 1, stop_at=k, **wsd), stable) == 0
    assert run(tiny(steps, init_from=f"{stable}:{k}", **wsd), fork) == 0
    a, s, f = losses(switched), losses(stable), losses(fork)
    assert all(a[i] == s[i] for i in range(1, k + 1)), (a, s)
    assert sorted(f) == list(range(k + 1, steps + 1)), f
    assert all(f[i] == a[i] for i in f), (f, a)
    record = json.load(open(os.path.join(fork, "config.json")))
    assert record["train"]["init_from"] == f"{stable}:{k}"
    # RUN alone forks from its newest checkpoint (here k, where the stable run stopped), recorded as resolved.
    newest = str(tmp_path / "newest")
    assert run(tiny(steps, init_from=stable, **wsd), newest) == 0
    assert losses(newest) == f
    record = json.load(open(os.path.join(newest, "config.json")))
    assert record["train"]["init_from"] == stable and record["resolved"]["train.init_from"] == f"{stable}:{k}"


# ---------------------------------------------------------------------------------------------- z-loss


def test_z_loss_value_and_gradient_against_numpy_and_autodiff():
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(2, 10, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 17)), jnp.float32)
    t = jnp.asarray(rng.integers(0, 17, size=(2, 10)), jnp.int32)
    z = 1e-2
    logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    logz = np.log(np.exp(logits).sum(-1))
    ce = np.mean(logz - np.take_along_axis(logits, np.asarray(t)[..., None], -1)[..., 0])
    loss, zm = chunked_lm_loss(h, w, t, 4, z)
    np.testing.assert_allclose(zm, np.mean(logz**2), rtol=1e-5)
    np.testing.assert_allclose(loss, ce + z * np.mean(logz**2), rtol=1e-5)

    def full(h, w):
        c, zz = cross_entropy_and_z(jnp.einsum("bte,ev->btv", h, w), t)
        return c + z * zz

    want = jax.grad(full, argnums=(0, 1))(h, w)
    got = jax.grad(lambda h, w: chunked_lm_loss(h, w, t, 4, z)[0], argnums=(0, 1))(h, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=2e-4, atol=1e-6)


@pytest.mark.slow
def test_z_loss_is_logged_apart_from_the_cross_entropy(tmp_path):
    wd = str(tmp_path)
    assert run(tiny(4, z_loss=1e-4), wd) == 0
    z = read_jsonl(os.path.join(wd, "metrics.jsonl"), "train/z_loss")
    assert sorted(z) == [1, 2, 3, 4] and all(v > 0 for v in z.values()), z


# ---------------------------------------------------------------------------------------------- spikes


@pytest.mark.slow
@pytest.mark.xla_emitters
def test_a_loss_spike_is_skipped_and_counted_and_no_spike_changes_nothing():
    from resformer_jax.resolve import resolve
    from resformer_jax.train.setup import build

    def setup(sigma):
        c = tiny(40, spike_sigma=sigma, spike_window=16)
        c.train.global_batch, c.data.seq_len = 4, 32
        return build(resolve(c, log=lambda m: None))

    rng = np.random.default_rng(0)
    fixed = jnp.asarray(np.tile(np.arange(33) % 7, (4, 1)), jnp.int32)  # a pattern the model learns quickly
    noise = jnp.asarray(rng.integers(0, 256, size=(4, 33)), jnp.int32)  # far higher loss: the spike
    on, off = setup(3.0), setup(0.0)
    s_on, s_off = on.init_state(), off.init_state()
    for _ in range(20):
        s_on, m_on = on.train_step(s_on, fixed)
        s_off, m_off = off.train_step(s_off, fixed)
        assert int(m_on["spike"]) == 0
        assert float(m_on["loss"]) == float(m_off["loss"])  # no spike: bitwise what the run without the feature does
    equal = lambda a, b: all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))
    assert equal(jax.device_get(s_on.params), jax.device_get(s_off.params))
    before = jax.device_get(s_on.params)  # (the step donates its input state)
    s_on, m = on.train_step(s_on, noise)
    assert int(m["spike"]) == 1 and int(s_on.spikes.skipped) == 1
    assert equal(jax.device_get(s_on.params), before)
    s_on, m = on.train_step(s_on, fixed)
    assert int(m["spike"]) == 0


@pytest.mark.slow
def test_a_spike_injected_into_a_run_is_skipped_counted_logged_and_replayed_on_resume(tmp_path, monkeypatch, capsys):
    """A run whose step 30 trains on random tokens (train/faults.py: RESFORMER_TEST_NOISE_BATCH): the update is
    not applied, the skip is printed with its step and counted in TensorBoard's scalars; a run stopped at step 20
    and resumed replays it exactly (bitwise the uninterrupted run's losses and count)."""
    monkeypatch.setenv("RESFORMER_TEST_NOISE_BATCH", "30")
    spiked, resumed = str(tmp_path / "spiked"), str(tmp_path / "resumed")
    assert run(tiny(40, spike_sigma=3.0, spike_window=16), spiked) == 0
    out = capsys.readouterr()
    assert "step 30: loss spike skipped" in out.out + out.err
    skipped = read_jsonl(os.path.join(spiked, "metrics.jsonl"), "train/skipped_spikes")
    assert skipped[29] == 0 and skipped[30] == 1 and skipped[40] == 1, skipped
    a = losses(spiked)
    assert a[30] > max(a[i] for i in range(14, 30)) + 0.3  # the noise batch's loss: the spike
    assert run(tiny(40, spike_sigma=3.0, spike_window=16, stop_at=20), resumed) == 0
    assert run(tiny(40, spike_sigma=3.0, spike_window=16), resumed) == 0
    assert losses(resumed) == a
    assert read_jsonl(os.path.join(resumed, "metrics.jsonl"), "train/skipped_spikes") == skipped


# ---------------------------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "flag,words",
    [
        ("--config.train.optimizer=lion", ["train.optimizer", "adamw, muon"]),
        ("--config.train.schedule=wsd --config.train.wsd_fractions=(0.1,0.5,0.2)", ["summing to 1"]),
        ("--config.train.wsd_decay_shape=exp", ["wsd_decay_shape", "1-sqrt"]),
        ("--config.train.init_from=:5", ["init_from", "names no run"]),
        ("--config.train.init_from=runs/none_here", ["init_from", "has no checkpoints"]),
        ("--config.train.z_loss=-1", ["z_loss"]),
        ("--config.train.spike_sigma=-2", ["spike_sigma"]),
    ],
)
def test_bad_recipe_values_are_one_line(tmp_path, flag, words):
    wd = tmp_path / "run"
    r = run_command("train", "--config=configs/tiny.py", f"--workdir={wd}", *flag.split())  # in-process
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr and err and err[-1].startswith("error:"), r.stderr
    assert all(w in err[-1] for w in words), err[-1]
    assert not wd.exists()


@pytest.mark.slow
def test_a_fork_from_another_shape_or_a_missing_step_is_one_line(tmp_path):
    src = str(tmp_path / "src")
    assert run(tiny(4), src) == 0
    for extra, words in (
        ([f"--config.train.init_from={src}:3"], ["no checkpoint at step 3", "available"]),
        ([f"--config.train.init_from={src}:4", "--config.model.d_model=32"], ["another model", "d_model"]),
    ):
        wd = tmp_path / "fork"
        r = run_command("train", "--config=configs/tiny.py", f"--workdir={wd}", *extra)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert all(w in r.stderr for w in words), r.stderr
        assert not (wd / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------- telemetry


def test_layer_norms_are_the_norms_of_each_layers_leaves():
    from resformer_jax.train.telemetry import layer_norms, scalars

    rng = np.random.default_rng(2)
    tree = {
        "embed": {"embedding": rng.normal(size=(10, 4))},
        "layer_1": {
            "attn": {"query": {"kernel": rng.normal(size=(4, 2, 2))}},
            "mlp": {"up": {"kernel": np.ones((4, 3))}},
        },
        "layers": {"block": {"attn": {"query": {"kernel": rng.normal(size=(2, 4, 2, 2))}}}},
        "lm_head": {"kernel": rng.normal(size=(4, 10))},
    }
    got = jax.device_get(layer_norms(jax.tree.map(jnp.asarray, tree), 3))
    q1, stack = tree["layer_1"]["attn"]["query"]["kernel"], tree["layers"]["block"]["attn"]["query"]["kernel"]
    want_attn = [np.linalg.norm(q1), np.linalg.norm(stack[0]), np.linalg.norm(stack[1])]
    np.testing.assert_allclose(got["attn"], want_attn, rtol=1e-5)
    np.testing.assert_allclose(got["mlp"], [np.sqrt(12.0), 0, 0], rtol=1e-6)
    np.testing.assert_allclose(got["embed_total"], np.linalg.norm(tree["embed"]["embedding"]), rtol=1e-5)
    flat = scalars({"grad_norm": got})
    assert flat["telemetry/grad_norm/attn/layer_02"] == pytest.approx(np.linalg.norm(stack[0]), rel=1e-5)
    assert "telemetry/grad_norm/head" in flat


@pytest.mark.slow
def test_the_steps_telemetry_is_its_gradient_parameter_and_update_norms():
    from resformer_jax.resolve import resolve
    from resformer_jax.train.setup import build
    from resformer_jax.train.step import loss_fn
    from resformer_jax.train.telemetry import layer_norms

    c = tiny(4, telemetry=True)
    c.train.global_batch, c.data.seq_len = 4, 32
    s = build(resolve(c, log=lambda m: None))
    state = s.init_state()
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(4, 33)), jnp.int32)
    grads = jax.grad(lambda p: loss_fn(p, s.model, batch, c.train.loss_chunk_len))(state.params)
    want_grad = jax.device_get(layer_norms(grads, c.model.num_layers))
    before = jax.device_get(state.params)
    assert "telemetry" not in jax.eval_shape(s.train_step, state, batch)[1]  # the plain step computes none
    state, m = s.telemetry_step(state, batch)
    tel = jax.device_get(m["telemetry"])
    for kind, v in want_grad.items():
        np.testing.assert_allclose(tel["grad_norm"][kind], v, rtol=1e-4, err_msg=kind)
    after = jax.device_get(state.params)
    upd = jax.device_get(layer_norms(jax.tree.map(lambda a, b: a - b, after, before), c.model.num_layers))
    for kind, v in upd.items():
        np.testing.assert_allclose(tel["update_norm"][kind], v, rtol=1e-4, atol=1e-9, err_msg=kind)
    np.testing.assert_allclose(tel["param_norm"]["attn"], layer_norms(after, c.model.num_layers)["attn"], rtol=1e-5)


# ---------------------------------------------------------------------------------------------- bits per byte

SHARED = os.path.join(ROOT, "..", "shared", "data")


def test_bytes_per_token_count_the_text_the_tokens_stand_for():
    from tokenizers import Tokenizer

    from resformer_jax.data.records import token_bytes

    path = os.path.join(SHARED, "tokenizers", "gpt-neox-20b.json")
    if not os.path.isfile(path):
        pytest.skip("../shared/data/tokenizers/gpt-neox-20b.json is absent (the shared data folder beside the repo)")
    tok = Tokenizer.from_file(path)
    table = token_bytes(tok, 50277)
    for text in ("Hello, world! Ünïcødé — ok ✓ 日本語", "def f(x):\n    return x*2\n\t\t  x\r\n", "a" * 300):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert int(table[ids].sum()) == len(text.encode("utf-8")), text
    assert table[tok.token_to_id("<|endoftext|>")] == 0


@pytest.mark.slow
def test_validation_reports_bits_per_byte_and_in_loop_tasks_equal_evaluate(tmp_path):
    import math

    from demo_runs import tokenized_tiny_config

    samples = os.path.join(SHARED, "eval_samples")
    if not os.path.isdir(samples):
        pytest.skip("../shared/data/eval_samples is absent (the shared data folder beside the repo)")
    c = tokenized_tiny_config(steps=4)
    c.train.eval_every, c.eval.tasks, c.eval.tasks_every, c.eval.task_data, c.eval.task_limit = 4, "piqa", 4, samples, 6
    wd = str(tmp_path / "run")
    assert run(c, wd) == 0
    rec = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
    last = [r for r in rec if "eval/bpb" in r][-1]
    domain = next(k.split("/")[1] for k in last if k.endswith("/bpb") and k.count("/") == 2)
    # the bytes the validation targets stand for, counted here from the run's own tokenizer and batches
    from tokenizers import Tokenizer

    from resformer_jax.data.pipeline import validation_sets
    from resformer_jax.data.records import token_bytes

    table = token_bytes(Tokenizer.from_file(os.path.join(wd, "tokenizer.json")), c.model.vocab_size)
    batches = validation_sets(c, c.train.global_batch, c.train.eval_batches, 0, 1)[domain]
    tokens, text_bytes = sum(b[:, 1:].size for b in batches), sum(int(table[b[:, 1:]].sum()) for b in batches)
    want = last[f"eval/{domain}/loss"] * tokens / (math.log(2) * text_bytes)
    assert last[f"eval/{domain}/bpb"] == pytest.approx(want, rel=1e-9)
    acc = [r["tasks/piqa/acc"] for r in rec if "tasks/piqa/acc" in r][-1]
    r = run_command("evaluate", f"--workdir={wd}", "--tasks=piqa", f"--task_data={samples}", "--limit=6")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.load(open(os.path.join(wd, "eval", "zero_shot_step4.json")))["tasks"]["piqa"]["acc"] == acc


# ---------------------------------------------------------------------------------------------- W&B


def wandb_history(path):
    """The scalars of an offline .wandb file: a LevelDB-style log (after a 7-byte header) of Record protobufs."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, rows, buf = open(path, "rb").read(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf + payload if kind == 4 else payload)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind == 2:
            buf = payload
        elif kind == 3:
            buf += payload
        elif kind == 0:
            pos += left
    return rows


@pytest.mark.slow
def test_weights_and_biases_offline_holds_the_scalars_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[wandb]'); CI installs it")
    wd = str(tmp_path / "run")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    base = ["train", "--config=configs/tiny.py", f"--workdir={wd}", "--config.train.log_every=1"]
    base += ["--config.train.wandb_project=resformer-test", "--config.mesh.num_devices=1"]
    first = run_command(*base, "--config.train.steps=4", "--config.train.stop_at=2")  # in-process: as a command
    assert first.returncode == 0, first.stderr[-2000:]
    run_id = open(os.path.join(wd, "wandb_run_id")).read().strip()
    second = run_command(*base, "--config.train.steps=4")
    assert second.returncode == 0, second.stderr[-2000:]
    runs = sorted(glob_wandb(wd))
    assert len(runs) == 2 and all(r.endswith(f"-{run_id}") for r in runs), runs
    logged = {}
    for r in runs:
        for row in wandb_history(os.path.join(r, f"run-{run_id}.wandb")):
            if "train/loss" in row:
                logged[row["_step"]] = row["train/loss"]
    assert logged == pytest.approx(read_jsonl(os.path.join(wd, "metrics.jsonl"), "train/loss"), rel=1e-6)


def glob_wandb(wd):
    import glob

    return glob.glob(os.path.join(wd, "wandb", "offline-run-*"))


def test_wandb_without_the_extra_is_one_config_error(monkeypatch):
    import importlib.util

    from resformer_jax.config import ConfigError, validate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    c = tiny(10, wandb_project="p")
    with pytest.raises(ConfigError, match=r"pip install -e '.\[wandb\]'"):
        validate(c)
