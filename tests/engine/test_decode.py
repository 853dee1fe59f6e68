"""KV-cache decoding and generation."""

import os

import pytest
from commands import run_command
from decoding import assert_decode_equals_forward, pool_bytes
from tiers import fast_few

from resformer_jax.config import validate
from resformer_jax.perf import summary
from resformer_jax.presets import paper_config, tiny_config

MODES = ["none", "resformer", "svformer", "neutreno", "resformer+neutreno"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "mode,kv",
    fast_few([(m, 2) for m in MODES] + [("svformer", 0), ("none", 0)], [("resformer", 2), ("svformer", 0)], True),
)
def test_prefill_plus_decode_equals_full_forward(mode, kv):
    c = tiny_config(mode)
    c.model.num_kv_heads = kv
    assert_decode_equals_forward(c)


@pytest.mark.parametrize("scan", fast_few([True, False], [False]))
def test_cross_layer_mapping_decode_equals_forward(scan):
    """Eq. 2 (mapping=cross_layer) over the paged cache: layer n attends over its own pages and layer 1's."""
    c = tiny_config("resformer")
    c.model.mapping, c.model.num_kv_heads, c.model.scan_layers = "cross_layer", 2, scan
    assert_decode_equals_forward(c)


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
    r = run_command(  # in-process, as the two below
        "generate",
        f"--workdir={wd}",
        "--prompt=the cat sat on the mat",
        "--max_new_tokens=24",
        "--devices=2",  # the engine on a mesh of two host devices: rows and pages split
    )
    assert r.returncode == 0, r.stderr
    assert "the cat sat on the mat and the dog ate the bone. the cat sat" in r.stdout, r.stdout
    assert '"kv_cache_bytes"' in r.stderr and "decode_tokens_per_s" in r.stderr
    # the run exported: generate takes the folder as serve and the lm-eval adapter do, and gives the same text
    from resformer_jax.hf.run_export import export_run
    from resformer_jax.load import load_run
    from resformer_jax.rundir import RunDir

    export_run(RunDir(wd), load_run(wd), str(tmp_path / "hf"))
    cmd = ["generate", f"--workdir={tmp_path / 'hf'}", "--max_new_tokens=24"]
    e = run_command(*cmd, "--prompt=the cat sat on the mat")
    assert e.returncode == 0 and e.stdout == r.stdout and '"step": null' in e.stderr, e.stderr[-2000:]
    # stop strings (vLLM's `stop`): the engine ends the text before the first one met
    stops = ["--prompt=the cat sat on the mat", "--stop= dog", "--stop=bone"]
    s = run_command(*cmd, *stops)
    assert s.returncode == 0 and s.stdout.startswith("the cat sat on the mat and the\n" + "-" * 40), s.stdout
