"""KV-cache decoding and generation."""

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resformer_jax.config import paper_config, tiny_config, validate
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.decode import _step, init_cache, kv_bytes, sample_logits
from resformer_jax.perf import summary

MODES = ["none", "resformer", "svformer", "neutreno", "resformer+neutreno"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_decode_equals_forward(c):
    """A 5-token prefill and 7 single-token steps through the KV cache give the full forward's logits."""
    validate(c)
    m = Transformer(ModelConfig.of(c.model))
    toks = jax.random.randint(jax.random.PRNGKey(0), (2, 12), 0, c.model.vocab_size)
    p = nn.unbox(jax.jit(m.init)(jax.random.PRNGKey(1), toks)["params"])
    full = jax.jit(m.apply)({"params": p}, toks)
    mf = ModelConfig.of(c.model)
    cache = init_cache(mf, p, 2, 16)
    logits, cache = _step(p, toks[:, :5], cache, m_frozen=mf, max_len=16)
    outs = [logits]
    for t in range(5, 12):
        logits, cache = _step(p, toks[:, t : t + 1], cache, m_frozen=mf, max_len=16)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-4, rtol=1e-4)
    return m, p


@pytest.mark.parametrize("mode,kv", [(m, 2) for m in MODES] + [("svformer", 0), ("none", 0)])
def test_prefill_plus_decode_equals_full_forward(mode, kv):
    c = tiny_config(mode)
    c.model.num_kv_heads = kv
    assert_decode_equals_forward(c)


@pytest.mark.parametrize("mode", ["none", "svformer"])
def test_a_prompt_prefilled_in_chunks_gives_the_one_call_prefill(mode):
    """generate's prefill in chunks (model/decode.prefill, so a 64K prompt fits a GPU): 12 tokens in chunks of 5
    (5, 5, 2) leave the same last logits and the same cache as one call."""
    from resformer_jax.model.decode import prefill

    c = tiny_config(mode)
    c.model.num_kv_heads = 2
    validate(c)
    m = Transformer(ModelConfig.of(c.model))
    toks = jax.random.randint(jax.random.PRNGKey(0), (2, 12), 0, c.model.vocab_size)
    p = nn.unbox(jax.jit(m.init)(jax.random.PRNGKey(1), toks)["params"])
    mf = ModelConfig.of(c.model)
    one, cache_one = _step(p, toks, init_cache(mf, p, 2, 16), m_frozen=mf, max_len=16)
    chunked, cache_chunked = prefill(p, toks, init_cache(mf, p, 2, 16), m_frozen=mf, max_len=16, chunk=5)
    np.testing.assert_allclose(chunked[:, -1], one[:, -1], atol=1e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), cache_chunked, cache_one)


@pytest.mark.parametrize("scan", [True, False])
def test_cross_layer_mapping_decode_equals_forward(scan):
    """Eq. 2 (mapping=cross_layer) in the KV-cached decode: layer n attends over its own cache and layer 1's."""
    c = tiny_config("resformer")
    c.model.mapping, c.model.num_kv_heads, c.model.scan_layers = "cross_layer", 2, scan
    assert_decode_equals_forward(c)


@pytest.mark.slow  # over 12 s in the fast tier
@pytest.mark.parametrize("kv", [2])
def test_svformer_cache_is_L_plus_1_over_2L_of_vanilla_and_matches_summary(kv):
    sizes = {}
    for mode in ("none", "svformer"):
        c = tiny_config(mode)
        c.model.num_layers, c.model.num_kv_heads = 8, kv
        validate(c)
        p = nn.unbox(
            jax.jit(Transformer(ModelConfig.of(c.model)).init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))[
                "params"
            ]
        )
        cache = init_cache(ModelConfig.of(c.model), p, 3, 40)
        sizes[mode] = kv_bytes(cache)
        assert sizes[mode] == summary(c)["kv_cache_bytes_per_token"] * 3 * 40
        # SVFormer's layers >= 2 hold no V at all.
        if mode == "svformer":
            assert "v" not in cache["layers"]["block"]["attn"] and "v" in cache["layer_1"]["attn"]
    assert sizes["svformer"] / sizes["none"] == (8 + 1) / (2 * 8)
    res = tiny_config("resformer")
    res.model.num_layers, res.model.num_kv_heads = 8, kv
    assert summary(res)["kv_cache_bytes_per_token"] * 3 * 40 == sizes["none"]  # ResFormer caches mixed V per layer
    full = paper_config("468m", "svformer")
    assert summary(full)["kv_cache_bytes_per_token"] == (24 + 1) * 16 * 64 * 2  # K per layer + V_1, bf16


def test_sampling_limits():
    logits = jnp.array([[0.0, 3.0, 1.0, 2.0]])
    rng = jax.random.PRNGKey(0)
    assert int(sample_logits(logits, rng, 0.0, 0, 1.0)[0]) == 1
    for s in range(20):
        assert int(sample_logits(logits, jax.random.PRNGKey(s), 1.0, 1, 1.0)[0]) == 1
        assert int(sample_logits(logits, jax.random.PRNGKey(s), 1.0, 0, 0.05)[0]) == 1
        assert int(sample_logits(logits, jax.random.PRNGKey(s), 1.0, 2, 1.0)[0]) in (1, 3)


@pytest.mark.slow
def test_greedy_generation_reproduces_repetitive_text(tmp_path):
    from resformer_jax.commands.training import run
    from resformer_jax.data_prep.prepare import prepare

    line = "the cat sat on the mat and the dog ate the bone. "
    raw = tmp_path / "raw" / "train"
    raw.mkdir(parents=True)
    (raw / "a.txt").write_text(line * 400)
    (tmp_path / "raw" / "validation").mkdir()
    (tmp_path / "raw" / "validation" / "b.txt").write_text(line * 40)
    prepare([str(tmp_path / "raw")], "train:300", str(tmp_path / "data"), seq_len=32, domain="Rep", quiet=True)
    c = tiny_config("svformer")
    c.data.source, c.data.path, c.data.seq_len = "array_record", str(tmp_path / "data"), 32
    c.model.vocab_size = 300
    c.train.steps, c.train.peak_lr, c.train.warmup_steps = 80, 1e-2, 5
    c.mesh.num_devices = 1
    wd = str(tmp_path / "run")
    assert run(c, wd) == 0
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "resformer_jax",
            "generate",
            f"--workdir={wd}",
            "--prompt=the cat sat on the mat",
            "--max_new_tokens=24",
            "--devices=2",  # the engine on a mesh of two host devices: rows and pages split
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "the cat sat on the mat and the dog ate the bone. the cat sat" in r.stdout, r.stdout
    assert '"kv_cache_bytes"' in r.stderr and "decode_tokens_per_s" in r.stderr


@pytest.mark.slow  # over 12 s in the fast tier
def test_generation_on_a_mesh_shards_the_cache_and_matches_one_device():
    import ml_collections

    from resformer_jax.model.decode import generate
    from resformer_jax.parallel.mesh import logical_shardings, make_mesh

    c = tiny_config("svformer")
    validate(c)
    model = Transformer(ModelConfig.of(c.model))
    boxed = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    params = nn.unbox(boxed)
    prompt = np.random.default_rng(0).integers(0, 256, (8, 6), dtype=np.int32)
    one, _ = generate(ModelConfig.of(c.model), params, prompt, max_new_tokens=5)
    mesh = make_mesh(ml_collections.ConfigDict({"data": 2, "fsdp": 4}))
    sh = logical_shardings(boxed, mesh, c.mesh)
    import resformer_jax.model.decode as dec

    seen = {}
    orig = dec._step

    def spy(params, tokens, cache, **kw):  # the cache is donated: read its layout before the call
        k = cache["layer_1"]["attn"]["k"]
        emb = params["embed"]["embedding"]
        seen.setdefault("k", (k.shape, k.addressable_shards[0].data.shape))
        seen.setdefault("emb", (emb.shape, emb.addressable_shards[0].data.shape))
        return orig(params, tokens, cache, **kw)

    dec._step = spy
    try:
        many, _stats = generate(
            ModelConfig.of(c.model), params, prompt, max_new_tokens=5, mesh=mesh, param_shardings=sh
        )
    finally:
        dec._step = orig
    np.testing.assert_array_equal(np.asarray(one), np.asarray(many))
    (k_full, k_shard), (e_full, e_shard) = seen["k"], seen["emb"]
    assert k_full[0] == 8 and k_shard[0] == 1, "the cache is split over the batch on 8 devices"
    assert e_shard[1] * 4 == e_full[1], "parameters keep their FSDP layout"
