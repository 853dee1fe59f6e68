"""The value-residual decoder against the paper's equations."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from tiers import fast_few

from resformer_jax.config import ConfigError, base_config, validate
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig
from resformer_jax.perf import summary
from resformer_jax.presets import paper_config, tiny_config
from resformer_jax.resolve import for_backend

MODES = ["none", "resformer", "svformer", "neutreno", "resformer+neutreno"]


def make(mode, kv_heads=0, scan=False, **model_overrides):
    c = tiny_config(mode)
    c.model.num_kv_heads = kv_heads
    c.model.scan_layers = scan
    c.model.attention_impl = "reference"
    for k, v in model_overrides.items():
        c.model[k] = v
    validate(c)
    return c


def init(c, T=16, seed=0):
    model = Transformer(for_backend(ModelConfig.of(c.model)))
    tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (2, T), 0, c.model.vocab_size)
    params = ref.init_params(model, tokens, seed)
    return model, params, tokens


@pytest.mark.parametrize("kv_heads", [0, 2])
@pytest.mark.parametrize("mode", MODES)
def test_matches_plain_jnp_reference(mode, kv_heads):
    c = make(mode, kv_heads)
    model, params, tokens = init(c)
    got = jax.jit(model.apply)({"params": params}, tokens)
    want = ref.forward(params, tokens, mode, c.model.num_layers)
    np.testing.assert_allclose(
        got, want, atol=1e-5, rtol=1e-5, err_msg=f"{mode} (kv_heads={kv_heads}) differs from the paper's equation"
    )


def test_svformer_later_layers_have_no_value_projection():
    c = make("svformer")
    _, params, _ = init(c)
    assert "value" in params["layer_1"]["attn"]
    for n in (2, 3):
        assert "value" not in params[f"layer_{n}"]["attn"], "Eq. 10: layers >= 2 have no W_V"


def test_resformer_with_l1_0_l2_1_is_vanilla_exactly():
    c_res = make("resformer", lambda_init=(0.0, 1.0))
    c_van = make("none")
    model_res, params, tokens = init(c_res)
    out_res = jax.jit(model_res.apply)({"params": params}, tokens)
    out_van = jax.jit(Transformer(for_backend(ModelConfig.of(c_van.model))).apply)({"params": params}, tokens)
    np.testing.assert_array_equal(np.asarray(out_res), np.asarray(out_van))


@pytest.mark.parametrize("mode", fast_few(["resformer", "svformer"], ["svformer"]))
def test_scanned_equals_unrolled_outputs_and_grads(mode):
    c_un = make(mode, kv_heads=2, scan=False)
    c_sc = make(mode, kv_heads=2, scan=True)
    model_un, params, tokens = init(c_un)
    model_sc = Transformer(for_backend(ModelConfig.of(c_sc.model)))
    params_sc = ref.stack_unrolled(params, c_un.model.num_layers)

    def loss(model, p):
        return jnp.mean(jax.jit(model.apply)({"params": p}, tokens) ** 2)

    np.testing.assert_allclose(
        jax.jit(model_un.apply)({"params": params}, tokens),
        jax.jit(model_sc.apply)({"params": params_sc}, tokens),
        atol=1e-6,
        rtol=1e-6,
    )
    g_un = jax.jit(jax.grad(lambda p: loss(model_un, p)))(params)
    g_sc = ref.unstack_scanned(jax.jit(jax.grad(lambda p: loss(model_sc, p)))(params_sc), c_un.model.num_layers)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5), g_un, g_sc)


@pytest.mark.slow  # four remat policies' gradient programs: 7 s cold on 2 cores
@pytest.mark.parametrize("scan", [True])
def test_remat_policies_give_equal_gradients(scan):
    grads = {}
    for policy in ("none", "dots", "full"):
        c = make("resformer", scan=scan, remat=policy)
        model, params, tokens = init(c)
        grads[policy] = jax.jit(jax.grad(lambda p: jnp.mean(jax.jit(model.apply)({"params": p}, tokens) ** 2)))(params)
    for policy in ("dots", "full"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5), grads["none"], grads[policy])


@pytest.mark.parametrize("mode", ["resformer", "none", "svformer"])
def test_remat_dots_keeps_the_value_mix_a_layer_forms(mode):
    """remat=dots keeps each layer's Eq. 7 mix (its recompute would read V_1 again: the 1B's step on v6e-64 was 2.4%
    over vanilla's, docs/scaling-out.md), and nothing new where a layer attends over a projection's output (vanilla's
    V_n, SVFormer's V_1); remat=full keeps no mix."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    def kept(remat):
        model, params, tokens = init(make(mode, remat=remat))  # 3 layers, unrolled: each residual named
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(lambda p: jnp.mean(model.apply({"params": p}, tokens) ** 2), params)
        return [line for line in out.getvalue().splitlines() if "named 'value_mix'" in line]

    assert len(kept("dots")) == (2 if mode == "resformer" else 0), kept("dots")
    assert kept("full") == []


@pytest.mark.parametrize("mode", ["resformer", "svformer"])
def test_gradient_reaches_first_layer_values_from_later_layers(mode):
    c = make(mode)
    model, params, tokens = init(c)
    loss = lambda p, stop=False: jnp.mean(ref.forward(p, tokens, mode, 3, stop_v1=stop) ** 2)
    g_model = jax.jit(jax.grad(lambda p: jnp.mean(jax.jit(model.apply)({"params": p}, tokens) ** 2)))(params)
    g_ref = jax.jit(jax.grad(loss))(params)  # the reference compiled whole, not op by op
    g_stop = jax.jit(jax.grad(lambda p: loss(p, True)))(params)
    w = lambda g: np.asarray(g["layer_1"]["attn"]["value"]["kernel"])
    np.testing.assert_allclose(w(g_model), w(g_ref), atol=1e-7, rtol=1e-4)
    assert np.abs(w(g_model) - w(g_stop)).max() > 1e-4 * np.abs(w(g_stop)).max(), (
        "layer 1's W_V gets no gradient through V_1 from later layers"
    )


@pytest.mark.parametrize("mode", fast_few(MODES, ["resformer", "svformer"]))  # vanilla: the attention both run
def test_causality(mode):
    c = make(mode, kv_heads=2, scan=True)
    model, params, tokens = init(c)
    t = 7
    changed = tokens.at[:, t + 1].set((tokens[:, t + 1] + 1) % c.model.vocab_size)
    a = jax.jit(model.apply)({"params": params}, tokens)
    b = jax.jit(model.apply)({"params": params}, changed)
    np.testing.assert_array_equal(np.asarray(a[:, : t + 1]), np.asarray(b[:, : t + 1]))
    assert np.abs(np.asarray(a[:, t + 1 :] - b[:, t + 1 :])).max() > 0


@pytest.mark.parametrize("scan", [True])
def test_learnable_lambdas_receive_gradients(scan):
    c = make("resformer", scan=scan, resformer_lambdas="learnable")
    model, params, tokens = init(c)
    g = jax.jit(jax.grad(lambda p: jnp.mean(jax.jit(model.apply)({"params": p}, tokens) ** 2)))(params)
    blocks = [g["layers"]["block"]] if scan else [g["layer_2"], g["layer_3"]]
    for b in blocks:
        for name in ("lambda1", "lambda2"):
            assert np.all(np.abs(np.asarray(b[name])) > 0), f"{name} gets no gradient"


@pytest.mark.slow  # over 12 s in the fast tier
def test_paper_param_counts_and_kv_cache():
    expected = {"82m": 81.9e6, "180m": 179.8e6, "468m": 467.9e6}
    for size, n in expected.items():
        van = summary(paper_config(size, "none"))
        sv = summary(paper_config(size, "svformer"))
        res = summary(paper_config(size, "resformer"))
        assert abs(van["params_total"] - n) / n < 1e-3, (size, van["params_total"])
        L, d = van["model"]["num_layers"], van["model"]["d_model"]
        assert van["params_total"] - sv["params_total"] == (L - 1) * d * d
        assert res["params_total"] == van["params_total"]
        assert sv["kv_cache_bytes_per_token"] / van["kv_cache_bytes_per_token"] == (L + 1) / (2 * L)
    assert (
        abs(
            summary(paper_config("82m", "svformer"))["kv_cache_bytes_per_token"]
            / summary(paper_config("82m", "none"))["kv_cache_bytes_per_token"]
            - 0.5625
        )
        < 1e-12
    )
    gqa = paper_config("82m", "none")
    gqa.model.num_kv_heads = 2
    assert (
        summary(gqa)["kv_cache_bytes_per_token"] / summary(paper_config("82m", "none"))["kv_cache_bytes_per_token"]
        == 2 / 8
    )
    sv_gqa = paper_config("468m", "svformer")
    sv_gqa.model.num_kv_heads = 4
    assert summary(sv_gqa)["kv_cache_bytes_per_token"] / summary(paper_config("468m", "none"))[
        "kv_cache_bytes_per_token"
    ] == pytest.approx(25 / 48 * 4 / 16, abs=0)


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("model.num_heads", 7, "num_heads"),
        ("model.num_kv_heads", 3, "num_kv_heads"),
        ("model.value_residual", "resformerr", "value_residual"),
        ("data.seq_len", 4096, "max_seq_len"),
        ("train.eval_every", 0, "eval_every"),  # was a ZeroDivisionError at the first step
        ("checkpoint.every_steps", -1, "every_steps"),
    ],
)
def test_impossible_config_names_field_and_fix(field, value, needle):
    c = paper_config("82m", "none")
    sec, name = field.split(".")
    c[sec][name] = value
    with pytest.raises(ConfigError, match=needle) as e:
        validate(c)
    assert "Fix:" in str(e.value)


def test_summary_cli_prints_json_and_bad_config_exits_cleanly():
    from commands import run_command  # in-process: the exit code and output a command gives

    out = run_command("train", "--config=configs/resformer_468m.py", "--mode=summary")
    assert out.returncode == 0, out.stderr[-2000:]
    s = json.loads(out.stdout)
    assert s["params_total"] == summary(paper_config("468m", "resformer"))["params_total"]
    assert s["model"]["value_residual"] == "resformer"
    bad = run_command("train", "--config=configs/resformer_82m.py", "--config.model.num_heads=7", "--mode=summary")
    assert bad.returncode != 0
    assert "config.model.num_heads" in bad.stderr and "Traceback" not in bad.stderr


def test_every_paper_config_loads():
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "configs"
    for size in ("2m", "82m", "180m", "468m"):
        for name, mode in (("transformer", "none"), ("resformer", "resformer"), ("svformer", "svformer")):
            spec = importlib.util.spec_from_file_location("c", root / f"{name}_{size}.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            c = validate(mod.get_config())
            assert c.model.value_residual == mode and c.model.vocab_size == 50277
    assert base_config().model.rope_theta == 10000.0


def test_fixed_lambdas_mix_in_the_value_dtype_only_where_it_holds_them_and_the_mix_is_the_fp32_ones():
    """Eq. 7 with l1 = l2 = 1/2 in bf16 is the fp32 mix rounded once, values and gradients bitwise; the plan mixes
    in the values' dtype only for constant weights that dtype holds exactly (learned ones and 0.3 stay fp32)."""
    from resformer_jax.model.attention import eq7_resformer_mix, plan_layer

    def plan(**fields):
        return plan_layer(ModelConfig(value_residual="resformer", num_layers=4, dtype="bfloat16", **fields), 2)

    assert plan().lambdas_in_value_dtype and plan(lambda_init=(1.0, 0.25)).lambdas_in_value_dtype
    assert not plan(lambda_init=(0.3, 0.7)).lambdas_in_value_dtype
    assert not plan(resformer_lambdas="learnable").lambdas_in_value_dtype
    assert not plan_layer(
        ModelConfig(value_residual="svformer", num_layers=4, dtype="bfloat16"), 2
    ).lambdas_in_value_dtype

    rng = np.random.default_rng(0)
    v1, vn, du = (jnp.asarray(rng.standard_normal((2, 64, 4, 32)), jnp.bfloat16) for _ in range(3))
    half = jnp.float32(0.5)

    def mix_and_grads(lam):
        f = lambda a, b: jnp.vdot(eq7_resformer_mix(a, b, lam, lam, jnp.bfloat16), du).astype(jnp.float32)
        return jax.jit(lambda a, b: (eq7_resformer_mix(a, b, lam, lam, jnp.bfloat16), jax.grad(f, (0, 1))(a, b)))(
            v1, vn
        )

    (mix32, grads32), (mix16, grads16) = mix_and_grads(half), mix_and_grads(half.astype(jnp.bfloat16))
    assert mix16.dtype == mix32.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(mix16, np.float32), np.asarray(mix32, np.float32))
    for g16, g32 in zip(grads16, grads32):
        np.testing.assert_array_equal(np.asarray(g16, np.float32), np.asarray(g32, np.float32))
