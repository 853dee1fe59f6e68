"""Value residual after the paper (#49): SkipV1Former, the convex lambda and the learned gate. Their equations are
pinned to tests/support/reference.py with the paper's ablations (test_ablations.py, configs/after_paper); here: the
identities that must hold between them and the paper's variants, decoding, KV-cache bytes, parameter counts,
gradients and bad combinations."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from decoding import assert_decode_equals_forward, pool_bytes
from tiers import fast_few

from resformer_jax.config import validate
from resformer_jax.model import Transformer
from resformer_jax.model.attention import ValueMix, gated_value, skipv1_value
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.lambdas import read_lambdas
from resformer_jax.model.transformer import unrolled_params
from resformer_jax.perf import summary
from resformer_jax.presets import tiny_config
from resformer_jax.resolve import for_backend


def cfg(mode="resformer", lambdas="fixed", kv=4, heads=4, layers=4, **model):
    c = tiny_config(mode)
    c.model.resformer_lambdas, c.model.num_kv_heads, c.model.num_heads, c.model.num_layers = lambdas, kv, heads, layers
    c.model.attention_impl, c.model.scan_layers = "reference", False
    for k, v in model.items():
        c.model[k] = v
    return validate(c)


def init(c, tokens):
    return ref.init_params(Transformer(for_backend(ModelConfig.of(c.model))), tokens)


def logits(c, params, tokens):
    return jax.jit(Transformer(for_backend(ModelConfig.of(c.model))).apply)({"params": params}, tokens)


TOKENS = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 256)


def test_the_gate_saturated_at_0_is_vanilla_and_at_1_svformers_value():
    rng = np.random.default_rng(0)
    own, first = (jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32) for _ in range(2))
    mix = lambda g: gated_value(ValueMix(own, first, first, 0.5, 0.5, jnp.float32, gate=jnp.full((2, 5, 4), g)))
    np.testing.assert_array_equal(mix(0.0), own)  # Eq. 1
    np.testing.assert_array_equal(mix(1.0), first)  # Eq. 10's value
    np.testing.assert_allclose(mix(0.5), 0.5 * first + 0.5 * own, rtol=1e-6)  # Eq. 7, fixed (1/2, 1/2)


def test_skipv1_takes_the_last_heads_from_layer_1_each_at_its_own_index():
    rng = np.random.default_rng(0)
    first = jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32)
    own = jnp.asarray(rng.normal(size=(2, 5, 3, 8)), jnp.float32)
    got = skipv1_value(ValueMix(own, None, first, 0.5, 0.5, jnp.float32))
    np.testing.assert_array_equal(got[:, :, :3], own)
    np.testing.assert_array_equal(got[:, :, 3:], first[:, :, 3:])
    assert skipv1_value(ValueMix(None, None, first, 0.5, 0.5, jnp.float32)) is first  # every head reused


def test_skipv1_with_0_reused_heads_is_vanilla_and_with_all_svformer():
    base = init(cfg("none"), TOKENS)
    none0 = cfg("skipv1", skipv1_reused_heads=0)
    assert jax.tree.structure(init(none0, TOKENS)) == jax.tree.structure(base)  # vanilla's parameters, all of them
    np.testing.assert_array_equal(logits(none0, base, TOKENS), logits(cfg("none"), base, TOKENS))
    sv = init(cfg("svformer"), TOKENS)
    all_ = cfg("skipv1", skipv1_reused_heads=4)
    assert jax.tree.structure(init(all_, TOKENS)) == jax.tree.structure(sv)  # no W_V in layers >= 2
    np.testing.assert_array_equal(logits(all_, sv, TOKENS), logits(cfg("svformer"), sv, TOKENS))


def test_convex_at_one_half_and_the_gate_at_zero_weights_are_resformers_fixed_mix():
    fixed = cfg("resformer")
    p = init(fixed, TOKENS)
    want = logits(fixed, p, TOKENS)
    convex = cfg("resformer", "convex")
    pc = init(convex, TOKENS)
    assert all(float(pc[f"layer_{n}"]["lambda"]) == 0.5 for n in range(2, 5))
    pc = {**p, **{f"layer_{n}": {**p[f"layer_{n}"], "lambda": jnp.float32(0.5)} for n in range(2, 5)}}
    np.testing.assert_allclose(logits(convex, pc, TOKENS), want, rtol=1e-6, atol=1e-6)
    gated = cfg("resformer", "gated")
    pg = init(gated, TOKENS)
    assert all(not np.any(pg[f"layer_{n}"]["attn"]["value_gate"]["kernel"]) for n in range(2, 5))  # W_g = 0
    pg = {
        **p,
        **{
            f"layer_{n}": {
                **p[f"layer_{n}"],
                "attn": {**p[f"layer_{n}"]["attn"], "value_gate": pg[f"layer_{n}"]["attn"]["value_gate"]},
            }
            for n in range(2, 5)
        },
    }
    np.testing.assert_allclose(logits(gated, pg, TOKENS), want, rtol=1e-6, atol=1e-6)


def test_convex_lambdas_are_read_back_as_l1_and_1_minus_l1():
    c = cfg("resformer", "convex", scan_layers=True)
    p = init(c, TOKENS)
    p["layers"]["block"]["lambda"] = jnp.asarray([0.2, 0.5, 0.9], jnp.float32)
    got = read_lambdas(p, c.model)
    assert {n: round(d["lambda1"], 6) for n, d in got.items()} == {2: 0.2, 3: 0.5, 4: 0.9}
    assert {n: round(d["lambda2"], 6) for n, d in got.items()} == {2: 0.8, 3: 0.5, 4: 0.1}


@pytest.mark.parametrize(
    "mode,lambdas,kv,extra",
    [
        ("skipv1", "fixed", 4, {}),
        ("skipv1", "fixed", 2, {"skipv1_reused_heads": 1}),
        ("resformer", "gated", 2, {}),
        ("resformer", "convex", 4, {}),
        ("resformer", "convex", 2, {"value_embeddings": 2}),
        ("none", "fixed", 2, {"value_embeddings": 1, "value_embedding_gate": True}),
    ],
)
@pytest.mark.slow  # over 12 s in the fast tier
def test_decode_equals_forward(mode, lambdas, kv, extra):
    """Scanned parameters, which the engine's unrolled layers read one subtree a layer; the unrolled model's forward
    on those subtrees is the scanned model's, so its decode is its forward too (the engine runs unrolled either
    way: resolve.serving_model)."""
    c = cfg(mode, lambdas, kv=kv, scan_layers=True, attention_impl="auto", **extra)
    _, p = assert_decode_equals_forward(c)
    unrolled = cfg(mode, lambdas, kv=kv, scan_layers=False, attention_impl="auto", **extra)
    np.testing.assert_allclose(
        logits(unrolled, unrolled_params(p, unrolled.model.num_layers), TOKENS),
        logits(c, p, TOKENS),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.slow  # over 12 s in the fast tier
def test_skipv1s_cache_holds_only_its_own_heads_and_matches_the_summary():
    """L = 8, K = 4 value heads, 2 of them reused: layers >= 2 cache K in full and V at half, so the cache is
    (2 + 1.5 * 7) / 16 of vanilla's (about 22% less); measured on the engine's pools, equal to --mode=summary's."""
    sizes = {}
    for mode in ("none", "skipv1"):
        c = cfg(mode, layers=8, scan_layers=True)
        sizes[mode], pools = pool_bytes(c)
        assert sizes[mode] == summary(c)["kv_cache_bytes_per_token"] * 3 * 40
        if mode == "skipv1":  # value heads: 2 of layer 2's own, 4 of layer 1's
            assert pools["layer_2"]["attn"]["v"].size * 2 == pools["layer_1"]["attn"]["v"].size
    assert sizes["skipv1"] / sizes["none"] == (2 + 1.5 * 7) / 16


def test_value_embeddings_at_scale_0_are_the_base_variant_and_their_tables_are_counted_apart():
    """a = 1, b = 0 (and a gate of 0) leave V_n as it was: the base variant's logits with its own parameters.
    --mode=summary counts the tables apart (N x vocab x K x D), outside the non-embedding parameters."""
    from resformer_jax.model.attention import value_embedding_mix

    v, ve = (jnp.asarray(np.random.default_rng(i).normal(size=(2, 5, 2, 8)), jnp.float32) for i in (0, 1))
    np.testing.assert_array_equal(value_embedding_mix(v, ve, 1.0, 0.0, None, jnp.float32), v)
    np.testing.assert_array_equal(value_embedding_mix(v, ve, None, None, jnp.zeros((2, 5, 2)), jnp.float32), v)
    base_cfg, ve_cfg = cfg("resformer", "convex", kv=2), cfg("resformer", "convex", kv=2, value_embeddings=2)
    base = init(base_cfg, TOKENS)
    p = init(ve_cfg, TOKENS)
    for n in range(1, 5):  # with 4 layers and 2 pairs every layer has a table; scale them out
        p[f"layer_{n}"]["attn"]["ve_lambdas"] = jnp.asarray([1.0, 0.0], jnp.float32)
    for name in base:
        if name.startswith("layer_"):
            p[name] = {**p[name], **{k: v for k, v in base[name].items() if k != "attn"}}
            p[name]["attn"] = {**base[name]["attn"], "ve_lambdas": p[name]["attn"]["ve_lambdas"]}
        else:
            p[name] = base[name]
    np.testing.assert_allclose(logits(ve_cfg, p, TOKENS), logits(base_cfg, base, TOKENS), rtol=1e-6, atol=1e-6)
    s_base, s_ve = summary(base_cfg), summary(ve_cfg)
    assert s_ve["params_value_embeddings"] == 2 * 256 * 2 * 16
    assert s_ve["params_non_embedding"] == s_base["params_non_embedding"] + 4 * 2  # two scalars a layer with a table
    assert s_ve["params_total"] == s_base["params_total"] + 2 * 256 * 2 * 16 + 4 * 2
    assert s_ve["kv_cache_bytes_per_token"] == s_base["kv_cache_bytes_per_token"]  # a lookup, no cache


def test_parameter_counts_are_the_hand_counts():
    E, D, L, K = 64, 16, 4, 4  # tiny: d_model 64, 4 heads of 16
    base = summary(cfg("none"))["params_total"]
    assert summary(cfg("skipv1"))["params_total"] == base - (L - 1) * E * 2 * D  # W_V of layers >= 2 halved
    assert summary(cfg("skipv1", skipv1_reused_heads=1))["params_total"] == base - (L - 1) * E * 1 * D
    assert summary(cfg("resformer", "convex"))["params_total"] == base + (L - 1)  # one lambda a layer >= 2
    assert summary(cfg("resformer", "gated"))["params_total"] == base + (L - 1) * E * K  # W_g: E -> K


@pytest.mark.parametrize(
    "mode,lambdas",
    fast_few([("skipv1", "fixed"), ("resformer", "gated"), ("resformer", "convex")], [("resformer", "gated")], True),
)
def test_gradients_match_finite_differences(mode, lambdas):
    """The loss's directional derivative along a random direction, autodiff against a central difference (fp32,
    a small model: the new parameters and the value paths of every layer are in it)."""
    from resformer_jax.train.step import loss_fn

    c = cfg(mode, lambdas, layers=3)
    model = Transformer(for_backend(ModelConfig.of(c.model)))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 9), 0, 256)
    p = init(c, tokens[:, :-1])
    rng = np.random.default_rng(0)
    p = jax.tree.map(lambda x: x + jnp.asarray(rng.normal(0, 0.05, x.shape), x.dtype), p)  # move off the init
    d = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), p)
    eps = 1e-3

    @jax.jit  # one program: the gradient's projection on d, and the loss a step of eps either side along d
    def along_and_ends(p, d):
        f = lambda q: loss_fn(q, model, tokens, 0)
        along = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(jax.grad(f)(p)), jax.tree.leaves(d)))
        end = lambda s: f(jax.tree.map(lambda x, y: x + s * eps * y, p, d))
        return along, end(1.0), end(-1.0)

    along, plus, minus = (float(x) for x in along_and_ends(p, d))
    fd = (plus - minus) / (2 * eps)
    assert abs(fd - along) <= 2e-2 * abs(along) + 1e-3, (fd, along)


@pytest.mark.parametrize(
    "flags,words",
    [
        (
            ["--config.model.value_residual=skipv1", "--config.model.num_heads=1", "--config.model.num_kv_heads=1"],
            ["skipv1_reused_heads", "odd"],
        ),
        (
            ["--config.model.value_residual=skipv1", "--config.model.skipv1_reused_heads=9"],
            ["skipv1_reused_heads", "0.."],
        ),
        (["--config.model.resformer_lambdas=lerp"], ["resformer_lambdas", "gated"]),
        (["--config.model.value_embeddings=2"], ["value_embeddings", "0..1"]),  # tiny: 3 layers
        (
            ["--config.model.value_residual=svformer", "--config.model.value_embeddings=1"],
            ["value_embeddings", "own value"],
        ),
    ],
)
def test_bad_combinations_are_one_line(tmp_path, flags, words):
    """`resformer train` (= python -m resformer_jax.main) called in-process: the message and status, not the process
    (a fresh interpreter's exit on a bad config: tests/commands/test_errors_commands.py)."""
    from commands import run_command

    wd = tmp_path / "run"
    r = run_command("train", "--config=configs/tiny.py", f"--workdir={wd}", *flags)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr and err[-1].startswith("error:"), r.stderr[-2000:]
    assert all(w in err[-1] for w in words), err[-1]
    assert not wd.exists()


@pytest.mark.parametrize(
    "model,words",
    [
        ({"value_residual": "neutreno"}, ["value_residual='neutreno'", "no Hugging Face export"]),
        ({"value_residual": "resformer", "cla_share_every": 2}, ["cla_share_every=2", "no Hugging Face export"]),
        ({"value_residual": "resformer", "value_source": "previous"}, ["value_source='previous'"]),
    ],
)
def test_the_hf_export_refuses_what_its_twin_does_not_compute_by_name(model, words):
    """skipv1, convex, gated and value embeddings export (tests/hf/test_hf.py); what the twin cannot compute stops."""
    from resformer_jax.hf.export import HFError, hf_tensors

    extra = {k: v for k, v in model.items() if k not in ("value_residual", "resformer_lambdas")}
    c = cfg(**{"mode": model["value_residual"], "lambdas": model.get("resformer_lambdas", "fixed")}, **extra)
    with pytest.raises(HFError) as e:
        hf_tensors(c.model, init(c, TOKENS))
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant,lambdas,tables", [("skipv1", "fixed", 0), ("resformer", "gated", 0), ("resformer", "convex", 1)]
)
def test_the_new_variants_compile_for_8_h100s_with_the_kernel_inside(variant, lambdas, tables):
    """train, eval and decode compiled for h100x8 (aot extra): the Pallas kernel in the train and eval steps,
    everything fitting; SkipV1Former's decode cache is its own."""
    from compile_targets import TARGETS, TRITON, accelerator_config, needs_aot

    if needs_aot.args[0]:
        pytest.skip(needs_aot.kwargs["reason"])
    from resformer_jax.compilation.aot import compile_for_target
    from resformer_jax.compilation.targets import parse_target

    c = accelerator_config(variant, "cuda")
    c.model.resformer_lambdas, c.model.value_embeddings = lambdas, tables
    report = compile_for_target(c, parse_target(TARGETS["cuda"]), steps=("train", "eval", "decode"), log=lambda s: None)
    by = {s.name: s for s in report.steps}
    assert report.attention_impl == "pallas" and by["train"].custom_calls.get(TRITON, 0) >= 2
    assert all(s.fits for s in report.steps), report.steps


@pytest.mark.slow
def test_a_gated_run_logs_its_gates_and_a_convex_run_its_lambdas_per_layer(tmp_path):
    """Over training, TensorBoard's scalars (metrics.jsonl mirrors them) hold each layer's mean gate at every
    evaluation (1/2 at the start: W_g = 0) and each layer's convex lambda at every log."""
    import json

    from resformer_jax.commands.training import run

    for lambdas, key, first in (
        ("gated", "gates/layer_02/value_gate", 0.5),
        ("convex", "lambdas/layer_02/lambda1", None),
    ):
        c = tiny_config("resformer")
        c.model.resformer_lambdas, c.model.remat = lambdas, "full"
        c.train.steps, c.train.log_every, c.train.eval_every, c.mesh.num_devices = 10, 5, 5, 1
        wd = str(tmp_path / lambdas)
        assert run(c, wd) == 0
        rec = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
        got = {r["step"]: r[key] for r in rec if key in r}
        assert len(got) >= 2, got
        if first is not None:
            assert got[0] == first and got[10] != first
        else:
            assert got[10] != 0.5 and 0 < got[10] < 1
