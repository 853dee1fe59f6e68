"""KV-cache decoding and generation."""

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resformer_jax.config import validate
from resformer_jax.engine import Engine, SamplingParams
from resformer_jax.model import Transformer
from resformer_jax.model.attention import PageLayout
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.transformer import pool_shapes
from resformer_jax.perf import summary
from resformer_jax.presets import paper_config, tiny_config
from resformer_jax.resolve import for_backend

MODES = ["none", "resformer", "svformer", "neutreno", "resformer+neutreno"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_decode_equals_forward(c):
    """The engine's paged steps (a 12-token prompt in chunks of 5 over pages of 4, then 6 tokens, 4 decode steps a
    program) give the cache-free full forward's log-probabilities at every position, prompt and generated, and each
    generated token is the forward's most likely (within round-off: a random init's logits are nearly flat)."""
    validate(c)
    m = for_backend(ModelConfig.of(c.model))
    model = Transformer(m)
    toks = jax.random.randint(jax.random.PRNGKey(0), (1, 12), 0, c.model.vocab_size)
    p = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(1), toks)["params"])
    engine = Engine(m, p, cache_bytes=2**22, page_size=4, max_batch=2, prefill_chunk=5, decode_steps=4)
    (r,) = engine.generate([toks[0].tolist()], SamplingParams(max_tokens=6, logprobs=1, prompt_logprobs=1))
    ids = toks[0].tolist() + r.tokens
    logp = np.asarray(jax.nn.log_softmax(jax.jit(model.apply)({"params": p}, jnp.array([ids]))[0], -1))
    want = [logp[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(r.scores.logprob[1:], want, atol=1e-4, rtol=1e-4)
    for i in range(12, len(ids)):
        assert logp[i - 1, ids[i]] >= logp[i - 1].max() - 1e-4, f"generated token {i - 12} is not the greedy one"
    return model, p


@pytest.mark.parametrize("mode,kv", [(m, 2) for m in MODES] + [("svformer", 0), ("none", 0)])
def test_prefill_plus_decode_equals_full_forward(mode, kv):
    c = tiny_config(mode)
    c.model.num_kv_heads = kv
    assert_decode_equals_forward(c)


@pytest.mark.parametrize("scan", [True, False])
def test_cross_layer_mapping_decode_equals_forward(scan):
    """Eq. 2 (mapping=cross_layer) over the paged cache: layer n attends over its own pages and layer 1's."""
    c = tiny_config("resformer")
    c.model.mapping, c.model.num_kv_heads, c.model.scan_layers = "cross_layer", 2, scan
    assert_decode_equals_forward(c)


def pool_bytes(c, pages=3, page_size=40):
    """The engine's cache pools for `pages` pages of `page_size` tokens under config c: (bytes, the pools)."""
    pools = pool_shapes(
        Transformer(for_backend(ModelConfig.of(c.model)).replace(scan_layers=False), pages=PageLayout(pages, page_size))
    )
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(pools))), pools


@pytest.mark.parametrize("kv", [2])
def test_svformer_cache_is_L_plus_1_over_2L_of_vanilla_and_matches_summary(kv):
    sizes = {}
    for mode in ("none", "svformer"):
        c = tiny_config(mode)
        c.model.num_layers, c.model.num_kv_heads = 8, kv
        validate(c)
        sizes[mode], pools = pool_bytes(c)
        assert sizes[mode] == summary(c)["kv_cache_bytes_per_token"] * 3 * 40
        # SVFormer's layers >= 2 hold no V at all.
        if mode == "svformer":
            assert "v" not in pools["layer_2"]["attn"] and "v" in pools["layer_1"]["attn"]
    assert sizes["svformer"] / sizes["none"] == (8 + 1) / (2 * 8)
    res = tiny_config("resformer")
    res.model.num_layers, res.model.num_kv_heads = 8, kv
    assert summary(res)["kv_cache_bytes_per_token"] * 3 * 40 == sizes["none"]  # ResFormer caches mixed V per layer
    full = paper_config("468m", "svformer")
    assert summary(full)["kv_cache_bytes_per_token"] == (24 + 1) * 16 * 64 * 2  # K per layer + V_1, bf16


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
    # the run exported: generate takes the folder as serve and the lm-eval adapter do, and gives the same text
    from resformer_jax.hf.run_export import export_run
    from resformer_jax.load import load_run
    from resformer_jax.rundir import RunDir

    export_run(RunDir(wd), load_run(wd), str(tmp_path / "hf"))
    cmd = [sys.executable, "-m", "resformer_jax", "generate", f"--workdir={tmp_path / 'hf'}", "--max_new_tokens=24"]
    e = subprocess.run([*cmd, "--prompt=the cat sat on the mat"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert e.returncode == 0 and e.stdout == r.stdout and '"step": null' in e.stderr, e.stderr[-2000:]
