"""Hugging Face Llama-family checkpoints as this project's model (Fig. 1 right / Fig. 15 right):
import from local safetensors, equal to the HF forward, and the paper's analysis on them."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import reference as ref
from commands import run_command
from hf_models import TEXT, write_tiny_llama
from tiers import fast_few

from resformer_jax.hf.llama_import import HFError, load_hf_llama
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig
from resformer_jax.resolve import for_backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("tie,kv,shards", [(False, 2, 1), (True, 4, 3)])
def test_imported_llama_equals_the_hf_forward(tmp_path, tie, kv, shards):
    sd, cfg = write_tiny_llama(str(tmp_path / "m"), tie=tie, kv=kv, shards=shards)
    m, params = load_hf_llama(str(tmp_path / "m"))
    assert (m.num_kv_heads, m.rope_theta, m.norm_eps) == (kv, 500000.0, 1e-6)
    tokens = np.random.default_rng(1).integers(0, cfg["vocab_size"], (2, 20))
    got = jax.jit(Transformer(for_backend(m)).apply)({"params": params}, tokens)
    want = ref.hf_llama_forward_numpy(sd, cfg, tokens)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4)


def test_import_errors_are_clear(tmp_path):
    with pytest.raises(HFError, match="no config.json"):
        load_hf_llama(str(tmp_path))
    write_tiny_llama(str(tmp_path / "m"))
    cfg = json.load(open(tmp_path / "m" / "config.json"))
    json.dump(
        dict(cfg, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]),
        open(tmp_path / "m" / "config.json", "w"),
    )
    with pytest.raises(HFError, match="not a Llama-family model"):
        load_hf_llama(str(tmp_path / "m"))
    json.dump({"model_type": "llama"}, open(tmp_path / "m" / "config.json", "w"))  # was a KeyError traceback
    with pytest.raises(HFError, match="lacks vocab_size, num_hidden_layers"):
        load_hf_llama(str(tmp_path / "m"))


def test_analyze_a_pretrained_llama_from_local_safetensors(tmp_path):
    model = tmp_path / "tiny-llama"
    write_tiny_llama(str(model))
    (tmp_path / "text.txt").write_text(TEXT)
    before = sorted(os.listdir(model))
    cmd = [f"--hf_model={model}", f"--text_file={tmp_path / 'text.txt'}"]
    stream = ["--seq_len=32", "--num_sequences=4", "--text_unit=stream"]
    r = run_command("analyze", *cmd, *stream, f"--out={tmp_path / 'an'}")  # in-process
    assert r.returncode == 0, r.stderr[-3000:]
    an = json.load(open(tmp_path / "an" / "analysis.json"))[0]
    assert an["source"] == "hugging face checkpoint" and an["variant"] == "tiny-llama" and an["num_sequences"] == 4
    ent = an["layers"]["entropy"]
    assert len(ent) == 3 and all(0 < e <= np.log(32) + 1e-9 for e in ent)
    assert len(an["layers"]["similarity"]) == 3 and os.path.getsize(tmp_path / "an" / "entropy.png") > 1000
    assert sorted(os.listdir(model)) == before, "nothing is written into the model folder"
    # --seq_len's default (512) past this model's 256 positions: the flag named, not two config fields
    r = run_command("analyze", *cmd, f"--out={tmp_path / 'an2'}")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"error: --seq_len=512 exceeds the context of {model} (256 tokens); pass --seq_len 256 or less"
    ), r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "an2")


EXPORT_CASES = {
    "none": {"value_residual": "none", "num_kv_heads": 2},
    "resformer": {"value_residual": "resformer", "lambda_init": (2.0, 1.0)},
    "resformer_learnable": {"value_residual": "resformer", "resformer_lambdas": "learnable"},
    "resformer_learnable_plus": {"value_residual": "resformer", "resformer_lambdas": "learnable_plus"},
    "resformer_sparse": {"value_residual": "resformer", "resformer_lambdas": "sparse", "sparse_layers": (3,)},
    "svformer_gqa": {"value_residual": "svformer", "num_kv_heads": 2},
    "resformer_convex": {"value_residual": "resformer", "resformer_lambdas": "convex"},
    "resformer_gated_gqa": {"value_residual": "resformer", "resformer_lambdas": "gated", "num_kv_heads": 2},
    "skipv1": {"value_residual": "skipv1"},
    "skipv1_gqa_all_heads": {"value_residual": "skipv1", "num_kv_heads": 2, "skipv1_reused_heads": 2},
    "resformer_value_embeddings": {"value_residual": "resformer", "value_embeddings": 1},
    "none_gated_value_embeddings": {"value_residual": "none", "value_embeddings": 1, "value_embedding_gate": True},
}


def _model_and_params(fields, scan=True):

    from resformer_jax.config import validate
    from resformer_jax.presets import tiny_config

    c = tiny_config()
    c.model.scan_layers = scan
    for k, v in fields.items():
        c.model[k] = v
    validate(c)
    model = Transformer(for_backend(ModelConfig.of(c.model)))
    params = ref.init_params(model, np.zeros((1, 8), np.int32))
    rng = np.random.default_rng(0)  # move the mixing scalars off their init so the test sees them
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: (
            x + rng.normal(0, 0.3, np.shape(x)).astype(np.float32)
            if p[-1].key in ("lambda1", "lambda2", "lambda", "lambda_logits", "lambda_scale", "ve_lambdas")
            or (p[-2].key in ("value_gate", "ve_gate") if len(p) > 1 else False)
            else x
        ),
        params,
    )
    return c, model, params


@pytest.mark.parametrize(
    "case",
    fast_few(
        sorted(EXPORT_CASES), ["none", "resformer_gated_gqa", "skipv1", "svformer_gqa", "resformer_value_embeddings"]
    ),
)
def test_export_round_trip_is_bitwise_and_logits_match_hf_llama(tmp_path, case):
    from resformer_jax.hf.export import export_params
    from resformer_jax.model.transformer import unrolled_params as unrolled

    c, model, params = _model_and_params(EXPORT_CASES[case])
    out = str(tmp_path / "hf")
    hf_cfg = export_params(ModelConfig.of(c.model), jax.device_get(params), out)
    m2, back = load_hf_llama(out)
    flat = lambda t: {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(t)}
    want, got = flat(unrolled(jax.device_get(params), c.model.num_layers)), flat(back)
    assert sorted(want) == sorted(got)
    for k in want:
        assert want[k].dtype == got[k].dtype and np.array_equal(want[k], got[k]), k
    tokens = np.random.default_rng(1).integers(0, c.model.vocab_size, (2, 16))
    ours = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
    from safetensors.numpy import load_file

    sd = load_file(os.path.join(out, "model.safetensors"))
    np.testing.assert_allclose(ref.hf_llama_forward_numpy(sd, hf_cfg, tokens), ours, atol=1e-4, rtol=1e-4)
    re_model = Transformer(for_backend(m2))
    np.testing.assert_allclose(
        np.asarray(jax.jit(re_model.apply)({"params": back}, tokens)), ours, atol=1e-5, rtol=1e-5
    )
    if case == "none":
        assert hf_cfg["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in hf_cfg
        assert not os.path.exists(os.path.join(out, "modeling_resformer.py"))
    else:
        assert hf_cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_resformer.ResFormerLlamaForCausalLM"
        assert os.path.isfile(os.path.join(out, "modeling_resformer.py"))


def test_vanilla_export_has_exactly_hf_llama_names_and_shapes(tmp_path):
    from safetensors.numpy import load_file

    from resformer_jax.hf.export import export_params

    c, _, params = _model_and_params({"value_residual": "none", "num_kv_heads": 2})
    export_params(
        ModelConfig.of(c.model), jax.device_get(params), str(tmp_path), shard_bytes=200_000
    )  # small shards: an index
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    sd = {}
    for f in sorted(set(index["weight_map"].values())):
        sd.update(load_file(str(tmp_path / f)))
    E, H, K, F, V, L = 64, 4, 2, 128, 256, 3
    D = E // H
    want = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,), "lm_head.weight": (V, E)}
    for i in range(L):
        p = f"model.layers.{i}."
        want.update(
            {
                p + "input_layernorm.weight": (E,),
                p + "post_attention_layernorm.weight": (E,),
                p + "self_attn.q_proj.weight": (H * D, E),
                p + "self_attn.k_proj.weight": (K * D, E),
                p + "self_attn.v_proj.weight": (K * D, E),
                p + "self_attn.o_proj.weight": (E, H * D),
                p + "mlp.gate_proj.weight": (F, E),
                p + "mlp.up_proj.weight": (F, E),
                p + "mlp.down_proj.weight": (E, F),
            }
        )
    assert {k: v.shape for k, v in sd.items()} == want
    cfg = json.load(open(tmp_path / "config.json"))
    assert (cfg["num_key_value_heads"], cfg["rms_norm_eps"], cfg["tie_word_embeddings"]) == (2, 1e-5, False)


def test_exported_model_loads_in_transformers(tmp_path):
    torch = pytest.importorskip(
        "torch",
        reason="transformers' own check needs torch, which is not installed here; "
        "the numpy HF Llama forward above checks the same logits",
    )
    transformers = pytest.importorskip("transformers")
    from resformer_jax.hf.export import export_params

    for case in sorted(EXPORT_CASES):
        c, model, params = _model_and_params(EXPORT_CASES[case])
        out = str(tmp_path / case)
        export_params(ModelConfig.of(c.model), jax.device_get(params), out)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
        tokens = np.random.default_rng(1).integers(0, c.model.vocab_size, (2, 16))
        with torch.no_grad():
            got = hf_model(torch.tensor(tokens)).logits.float().numpy()
        np.testing.assert_allclose(
            got, np.asarray(jax.jit(model.apply)({"params": params}, tokens)), atol=1e-5, rtol=1e-5
        )


# The twin's KV cache: what each layer keeps, and that cached greedy decoding is the engine's. Peaky logits (the LM
# head scaled up) so a greedy tie is never decided by float order between numpy, torch and XLA.
CACHE_CASES = [
    "none",
    "resformer_learnable",
    "resformer_gated_gqa",
    "svformer_gqa",
    "skipv1",
    "resformer_value_embeddings",
]


def _peaky_export(tmp_path, case):
    from resformer_jax.hf.export import export_params

    c, _model, params = _model_and_params(EXPORT_CASES[case])
    params = dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * 40.0})
    out = str(tmp_path / case)
    hf_cfg = export_params(ModelConfig.of(c.model), jax.device_get(params), out)
    return c, params, out, hf_cfg


def _engine_greedy(c, params, prompts, new):
    from resformer_jax.engine import Engine, SamplingParams

    m = for_backend(ModelConfig.of(c.model)).replace(dtype="float32")
    engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=4, prefill_chunk=16)
    return [r.tokens for r in engine.generate(prompts, SamplingParams(max_tokens=new))]


def _cache_bytes(case_cache):
    return sum(a.size for layer in case_cache for a in layer.values())


@pytest.mark.parametrize("case", fast_few(CACHE_CASES, ["skipv1", "resformer_gated_gqa"]))
def test_twin_cache_greedy_equals_the_engine_and_holds_what_each_layer_needs(tmp_path, case):
    """The cache logic of modeling_resformer.py, in the numpy reference (tests/support/reference.py): cached greedy
    decoding gives the engine's tokens; an SVFormer's cache holds (L+1)/(2L) of a vanilla Llama's elements, a
    SkipV1Former's layers their own heads; config.json says use_cache."""
    from safetensors.numpy import load_file

    c, params, out, hf_cfg = _peaky_export(tmp_path, case)
    assert hf_cfg["use_cache"] is True
    sd = load_file(os.path.join(out, "model.safetensors"))
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, c.model.vocab_size, n)] for n in (5, 11)]
    want = _engine_greedy(c, params, prompts, 8)
    for p, w in zip(prompts, want):
        got, cache = ref.hf_llama_greedy_numpy(sd, hf_cfg, p, 8)
        assert got == w, f"{case}: prompt of {len(p)} tokens"
    L, K, D = c.model.num_layers, c.model.num_kv_heads or c.model.num_heads, c.model.d_model // c.model.num_heads
    tokens = len(prompts[-1]) + 8 - 1  # the last sampled token is never fed back
    vanilla = 2 * L * K * D * tokens
    want_ratio = {"svformer_gqa": (L + 1) / (2 * L), "skipv1": None}.get(case, 1.0)
    if case == "skipv1":
        own = hf_cfg["layer_value_heads"]
        want_ratio = (L * K + sum(own)) / (2 * L * K)
        assert sum(own) < L * K
    assert _cache_bytes(cache) == pytest.approx(want_ratio * vanilla), case


def test_transformers_generate_with_the_twins_cache_equals_the_engine(tmp_path):
    torch = pytest.importorskip(
        "torch",
        reason="transformers' generate() needs torch, not installed here; the numpy test above checks the same cache",
    )
    transformers = pytest.importorskip("transformers")
    for case in CACHE_CASES:
        c, params, out, _ = _peaky_export(tmp_path, case)
        model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
        assert model.config.use_cache
        prompt = [int(t) for t in np.random.default_rng(4).integers(0, c.model.vocab_size, 9)]
        (want,) = _engine_greedy(c, params, [prompt], 8)
        with torch.no_grad():
            got = model.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, return_dict_in_generate=True
            )
        assert got.sequences[0, len(prompt) :].tolist() == want, case
        cache = getattr(got, "cache", None) or got.past_key_values
        layers = cache.layers
        held = sum(x.numel() for layer in layers for x in (layer.keys, layer.values))
        L, K = c.model.num_layers, c.model.num_kv_heads or c.model.num_heads
        full = 2 * L * K * (c.model.d_model // c.model.num_heads) * (len(prompt) + 8 - 1)
        if case == "svformer_gqa":
            assert held * 2 * L == full * (L + 1), "SVFormer's layers >= 2 must cache keys only"
            assert all(layer.values.numel() == 0 for layer in layers[1:])
        elif case in ("none", "resformer_learnable"):
            assert held == full


@pytest.mark.slow
def test_export_command_on_a_run(tmp_path):
    from resformer_jax.commands.training import run
    from resformer_jax.presets import tiny_config

    c = tiny_config("svformer")
    c.train.steps, c.mesh.num_devices = 3, 1
    assert run(c, str(tmp_path / "run")) == 0
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "resformer_jax",
            "export",
            f"--workdir={tmp_path / 'run'}",
            f"--out={tmp_path / 'hf'}",
            "--dtype=bfloat16",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["architectures"] == ["ResFormerLlamaForCausalLM"]
    assert json.load(open(tmp_path / "hf" / "config.json"))["torch_dtype"] == "bfloat16"
    assert os.path.isfile(tmp_path / "hf" / "generation_config.json") and "no tokenizer.json" in r.stderr
    # what serve, generate and lm-eval load: the export's torch_dtype is the compute dtype, as vLLM's --dtype=auto
    from resformer_jax.load import load_model
    from resformer_jax.model.transformer import cache_bytes_per_token

    exported, fp32 = load_model(str(tmp_path / "hf")), load_model(str(tmp_path / "run"))
    assert (exported.model.dtype, fp32.model.dtype, exported.step, fp32.step) == ("bfloat16", "float32", None, 3)
    assert cache_bytes_per_token(exported.model) == cache_bytes_per_token(fp32.model) // 2
    for loaded in (exported, fp32):  # on the device once, not host arrays copied into every step
        assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(loaded.params))
    bad = subprocess.run(
        [sys.executable, "-m", "resformer_jax", "export", f"--workdir={tmp_path / 'nope'}", f"--out={tmp_path / 'x'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama3_rope_frequencies_equal_the_hf_formula():
    """Meta-Llama-3.1-8B's rope_scaling (the authors' Fig. 1 right / Fig. 15 right model): head_dim 128,
    theta 500,000; and small original contexts, so the three frequency bands are all exercised."""
    from resformer_jax.model.layers import rope_frequencies

    for D, theta, orig in ((128, 500000.0, 8192), (8, 10000.0, 16), (64, 10000.0, 256)):
        rs = dict(LLAMA31, original_max_position_embeddings=orig)
        plain = 1.0 / theta ** (np.arange(0, D, 2) / D)
        want = ref.llama3_inv_freq_numpy(plain, rs)
        got = rope_frequencies(D, theta, "llama3", 8.0, 1.0, 4.0, orig)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
        assert not np.allclose(got, plain)  # the scaling is in effect
    assert np.allclose(rope_frequencies(8, 10000.0, "linear", 4.0), 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8) / 4)


@pytest.mark.parametrize("layout", ["transformers4", "transformers5"])
def test_llama3_scaled_checkpoint_imports_exactly_in_either_config_layout(tmp_path, layout):
    """A tiny Llama 3.1-style checkpoint (theta 500,000, llama3 scaling with a small original context so the
    scaling changes 40-token logits), its config written as transformers 4 does (top-level rope_theta and
    rope_scaling) or as transformers 5 does (rope_parameters only): the imported logits equal a numpy forward."""
    rs = dict(LLAMA31, original_max_position_embeddings=16)
    extra = (
        {"rope_scaling": rs}
        if layout == "transformers4"
        else {"rope_theta": None, "rope_parameters": {**rs, "rope_theta": 500000.0}}
    )
    sd, cfg = write_tiny_llama(str(tmp_path / "m"), extra=extra)
    m, params = load_hf_llama(str(tmp_path / "m"))
    assert (m.rope_type, m.rope_theta, m.rope_factor, m.rope_original_max_position) == ("llama3", 500000.0, 8.0, 16)
    tokens = np.random.default_rng(1).integers(0, cfg["vocab_size"], (2, 40))
    got = jax.jit(Transformer(for_backend(m)).apply)({"params": params}, tokens)
    want = ref.hf_llama_forward_numpy(sd, cfg, tokens)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4)
    plain = dict(cfg)
    plain.pop("rope_scaling", None)
    plain.pop("rope_parameters", None)
    plain["rope_theta"] = 500000.0
    assert np.abs(ref.hf_llama_forward_numpy(sd, plain, tokens) - want).max() > 1e-3  # the scaling matters here


def test_transformers5_theta_is_read_and_unimplemented_fields_stop_the_import(tmp_path):
    _sd, _cfg = write_tiny_llama(
        str(tmp_path / "m"),
        extra={"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    )
    m, _ = load_hf_llama(str(tmp_path / "m"))
    assert m.rope_theta == 500000.0 and m.rope_type == "default"
    for extra, words in (
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "'dynamic'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ):
        write_tiny_llama(str(tmp_path / "bad"), extra=extra)
        with pytest.raises(HFError, match=words):
            load_hf_llama(str(tmp_path / "bad"))
    write_tiny_llama(str(tmp_path / "sw"), extra={"sliding_window": 64})
    m, _ = load_hf_llama(str(tmp_path / "sw"))
    assert m.max_seq_len == 64  # sequences up to the window attend exactly as the model does


def test_tied_and_llama3_scaled_models_export_and_import_back_exactly(tmp_path):
    """An imported Llama 3.1-style checkpoint (llama3 RoPE) exported again carries its rope_scaling, and a model
    with tied embeddings exports the table as the head with tie_word_embeddings=true: both import back to the
    same logits."""
    from resformer_jax.hf.export import export_params
    from resformer_jax.presets import tiny_config

    rs = dict(LLAMA31, original_max_position_embeddings=16)
    write_tiny_llama(str(tmp_path / "m"), extra={"rope_scaling": rs})
    m, params = load_hf_llama(str(tmp_path / "m"))
    tokens = np.random.default_rng(1).integers(0, m.vocab_size, (2, 24))
    want = np.asarray(jax.jit(Transformer(for_backend(m)).apply)({"params": params}, tokens))
    cfg = export_params(m, params, str(tmp_path / "out"))
    assert (
        cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["original_max_position_embeddings"] == 16
    )
    m2, params2 = load_hf_llama(str(tmp_path / "out"))
    np.testing.assert_allclose(
        np.asarray(jax.jit(Transformer(for_backend(m2)).apply)({"params": params2}, tokens)), want, rtol=1e-6, atol=1e-6
    )
    c = tiny_config("none")
    c.model.tie_embeddings = True
    model = Transformer(for_backend(ModelConfig.of(c.model)))
    p = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)["params"]
    import flax.linen as nn

    p = nn.unbox(p)
    assert "lm_head" not in p
    cfg = export_params(ModelConfig.of(c.model), jax.device_get(p), str(tmp_path / "tied"))
    assert cfg["tie_word_embeddings"] is True
    m3, params3 = load_hf_llama(str(tmp_path / "tied"))
    np.testing.assert_allclose(
        np.asarray(jax.jit(Transformer(for_backend(m3)).apply)({"params": params3}, tokens)),
        np.asarray(jax.jit(model.apply)({"params": p}, tokens)),
        rtol=1e-5,
        atol=1e-5,
    )
