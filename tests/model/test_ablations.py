"""Every baseline and ablation as a config, each pinned to its equation."""

import glob
import importlib.util
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref
from tiers import fast_few

from resformer_jax.config import validate
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.transformer import cache_bytes_per_token
from resformer_jax.presets import apply_ablation, paper_config, tiny_config
from resformer_jax.resolve import for_backend
from resformer_jax.train.step import init_state, make_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The paper's ablations (configs/ablations) and the value-residual variants after it (configs/after_paper, #49)
FILES = {
    os.path.basename(p)[:-3]: p
    for folder in ("ablations", "after_paper")
    for p in glob.glob(os.path.join(ROOT, "configs", folder, "*.py"))
}
NAMES = sorted(FILES)


def load(name):
    spec = importlib.util.spec_from_file_location(name, FILES[name])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny(name, scan=False):
    c = tiny_config()
    c.model.num_layers = 4
    c.model.scan_layers = scan
    c.model.attention_impl = "reference"
    return validate(apply_ablation(c, load(name).ABLATION))


def test_every_ablation_config_is_valid_at_82m():
    assert len(NAMES) >= 20
    for name in NAMES:
        c = validate(load(name).get_config())
        assert c.model.d_model == 512 and c.model.num_layers == 8


# the fast tier: one config of each family (cross-layer KV, DenseFormer, GQA, the value mappings, NeuTRENO, the
# value gates, SkipV1, sharing, value embeddings, value sources, residuals on Q/K, learnable lambdas)
FAST_EQUATIONS = [
    "cla2", "denseformer", "gqa_half", "mapping_cross_layer", "neutreno", "resformer_gated", "skipv1",
    "svformer_share_k", "value_embeddings_gated", "value_source_previous", "residual_on_q", "resformer_learnable_plus",
]  # fmt: skip


@pytest.mark.parametrize("name", fast_few(NAMES, FAST_EQUATIONS))
def test_ablation_matches_its_equation(name):
    c = tiny(name)
    model = Transformer(for_backend(ModelConfig.of(c.model)))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, c.model.vocab_size)
    params = ref.init_params(model, tokens)
    # Mixing weights start at values that hide their equation (one-hot DenseFormer weights, equal
    # logits); move every non-matrix scalar so the test sees the whole formula.
    rng = np.random.default_rng(0)

    def jitter(path, x):
        key = [k.key for k in path if hasattr(k, "key")][-1]
        keys = [k.key for k in path if hasattr(k, "key")]
        scalars = ("alpha", "lambda1", "lambda2", "lambda", "lambda_logits", "lambda_scale", "ve_lambdas")
        if key in scalars or "value_gate" in keys or "ve_gate" in keys:
            return x + jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype)
        return x

    params = jax.tree_util.tree_map_with_path(jitter, params)
    got = jax.jit(model.apply)({"params": params}, tokens)
    want = ref.forward_general(params, tokens, c.model)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"{name} differs from its equation")


@pytest.mark.parametrize(
    "name",
    fast_few(
        [
            "value_source_previous",
            "residual_on_k",
            "resformer_learnable_plus",
            "resformer_sparse",
            "svformer_share_k",
            "resformer_convex",
            "resformer_gated_gqa",
            "skipv1_gqa",
        ],
        ["value_source_previous", "resformer_gated_gqa", "skipv1_gqa"],
    ),
)
def test_scanned_ablations_equal_unrolled(name):
    c_un, c_sc = tiny(name, scan=False), tiny(name, scan=True)
    model_un, model_sc = (
        Transformer(for_backend(ModelConfig.of(c_un.model))),
        Transformer(for_backend(ModelConfig.of(c_sc.model))),
    )
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, c_un.model.vocab_size)
    params = ref.init_params(model_un, tokens)
    stacked = ref.stack_unrolled(params, c_un.model.num_layers)
    np.testing.assert_allclose(
        jax.jit(model_un.apply)({"params": params}, tokens),
        jax.jit(model_sc.apply)({"params": stacked}, tokens),
        atol=1e-6,
        rtol=1e-6,
    )


def test_kv_cache_bytes_of_kv_sharing_configs():
    """The KV-cache bytes a token `--mode=summary` prints (perf.summary's cache_bytes_per_token of the run's
    model), without summary's memory estimate (an optimizer state traced over an 82M model a config)."""

    def kv(cfg):
        return cache_bytes_per_token(ModelConfig.of(validate(cfg).model))

    van = kv(paper_config("82m"))
    assert kv(load("cla2").get_config()) * 2 == van
    L, H = 8, 8
    sv_gqa = kv(load("svformer_gqa_eighth").get_config())
    assert sv_gqa / van == pytest.approx((L + 1) / (2 * L) * (2 / H), abs=0)
    assert kv(load("gqa_eighth").get_config()) / van == 1 / 8
    assert kv(load("gqa_half").get_config()) / van == 1 / 2


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)  # one test a config: the two workers share them
def test_every_ablation_trains_a_few_steps_on_its_tiny_override(name):
    tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 17), 0, 256)
    c = tiny(name, scan=True)  # typed: tiny_config's 3 layers
    model = Transformer(for_backend(c.model.replace(attention_impl="xla")))
    tx = optax.sgd(0.05)  # plain SGD: the point is the ablation's forward and backward, compiled fast
    state = nn.unbox(init_state(model, tx, jax.random.PRNGKey(0), 16))  # op by op: reference.init_params
    step = jax.jit(make_train_step(model, tx, 1))
    losses = []
    for _ in range(3):
        state, m = step(state, tokens)
        losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], (name, losses)


# the fast tier: cross-layer KV, whose cache differs most (layers reading another layer's pages); a gate or a mix is
# model arithmetic the engine runs through the same forward (pinned in the fast tier by the equation test above)
@pytest.mark.parametrize("name", fast_few(NAMES, ["cla2"]))
def test_every_ablation_decodes_through_the_engine_as_its_cache_free_forward(name):
    """#73: each ablation and after-paper variant on the tiny model, greedy through the paged engine, equals greedy
    decoding by the full forward over the whole prefix each token (no cache at all)."""
    from resformer_jax.engine import Engine, SamplingParams

    c = tiny(name)
    c = c.replace(model=c.model.replace(dtype="float32"))
    m = for_backend(ModelConfig.of(c.model))
    model = Transformer(m)
    params = ref.init_params(model, jnp.zeros((1, 8), jnp.int32))
    params = dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * 40.0})  # far-apart logits: no ties
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, m.vocab_size, size=k)] for k in (3, 9, 14)]
    # one prefill shape, one decode program, one page bucket: a compile or two a config
    engine = Engine(m, params, cache_bytes=2**21, page_size=8, max_batch=4, prefill_chunk=16, decode_steps=1)
    got = engine.generate(prompts, SamplingParams(max_tokens=6))
    assert len(engine.stats.compiled_shapes) <= 3, engine.stats.compiled_shapes
    forward = jax.jit(lambda t: model.apply({"params": params}, t))
    for p, r in zip(prompts, got):
        assert r.tokens == ref.greedy_uncached(forward, p, 6, pad_to=24), f"{name}: prompt of {len(p)} tokens"
    assert engine.pool.used == 0
