"""Hugging Face Llama-family checkpoints as this project's model (issue 18, Fig. 1 right / Fig. 15 right):
import from local safetensors, equal to the HF forward, and the paper's analysis on them."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import reference as ref
from resformer_jax.hf import HFError, load_hf_llama
from resformer_jax.model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "The quick brown fox jumps over the lazy dog. " * 40 + "def main():\n    return 42\n" * 30


def write_tiny_llama(folder, tie=False, kv=2, shards=1):
    """A tiny Llama-layout checkpoint: config.json, safetensors (sharded if asked), a trained tokenizer.json."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.save(os.path.join(folder, "tokenizer.json"))
    V, E, H, F, L = 320, 32, 4, 48, 3
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": E,
           "intermediate_size": F, "num_attention_heads": H, "num_key_value_heads": kv, "num_hidden_layers": L,
           "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "max_position_embeddings": 256, "tie_word_embeddings": tie}
    rng = np.random.default_rng(0)
    w = lambda *s: (rng.normal(size=s) * 0.1).astype(np.float32)  # noqa: E731
    D = E // H
    sd = {"model.embed_tokens.weight": w(V, E), "model.norm.weight": 1 + w(E)}
    if not tie:
        sd["lm_head.weight"] = w(V, E)
    for i in range(L):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": 1 + w(E), p + "post_attention_layernorm.weight": 1 + w(E),
                   p + "self_attn.q_proj.weight": w(H * D, E), p + "self_attn.k_proj.weight": w(kv * D, E),
                   p + "self_attn.v_proj.weight": w(kv * D, E), p + "self_attn.o_proj.weight": w(E, H * D),
                   p + "mlp.gate_proj.weight": w(F, E), p + "mlp.up_proj.weight": w(F, E),
                   p + "mlp.down_proj.weight": w(E, F)})
    names = sorted(sd)
    if shards == 1:
        save_file(sd, os.path.join(folder, "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            part = {n: sd[n] for n in names[s::shards]}
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, os.path.join(folder, fname))
            weight_map.update({n: fname for n in part})
        json.dump({"weight_map": weight_map}, open(os.path.join(folder, "model.safetensors.index.json"), "w"))
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    return sd, cfg


@pytest.mark.parametrize("tie,kv,shards", [(False, 2, 1), (True, 4, 3)])
def test_imported_llama_equals_the_hf_forward(tmp_path, tie, kv, shards):
    sd, cfg = write_tiny_llama(str(tmp_path / "m"), tie=tie, kv=kv, shards=shards)
    m, params = load_hf_llama(str(tmp_path / "m"))
    assert (m.num_kv_heads, m.rope_theta, m.norm_eps) == (kv, 500000.0, 1e-6)
    tokens = np.random.default_rng(1).integers(0, cfg["vocab_size"], (2, 20))
    got = jax.jit(Transformer(m).apply)({"params": params}, tokens)
    want = ref.hf_llama_forward_numpy(sd, cfg, tokens)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4)


def test_import_errors_are_clear(tmp_path):
    with pytest.raises(HFError, match="no config.json"):
        load_hf_llama(str(tmp_path))
    write_tiny_llama(str(tmp_path / "m"))
    cfg = json.load(open(tmp_path / "m" / "config.json"))
    json.dump(dict(cfg, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]), open(tmp_path / "m" / "config.json", "w"))
    with pytest.raises(HFError, match="not a Llama-family model"):
        load_hf_llama(str(tmp_path / "m"))


def test_analyze_a_pretrained_llama_from_local_safetensors(tmp_path):
    model = tmp_path / "tiny-llama"
    write_tiny_llama(str(model))
    (tmp_path / "text.txt").write_text(TEXT)
    before = sorted(os.listdir(model))
    r = subprocess.run([sys.executable, "-m", "resformer_jax.analyze", f"--hf_model={model}",
                        f"--text_file={tmp_path / 'text.txt'}", "--seq_len=32", "--num_sequences=4",
                        f"--out={tmp_path / 'an'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    an = json.load(open(tmp_path / "an" / "analysis.json"))[0]
    assert an["source"] == "hugging face checkpoint" and an["variant"] == "tiny-llama" and an["num_sequences"] == 4
    ent = an["layers"]["entropy"]
    assert len(ent) == 3 and all(0 < e <= np.log(32) + 1e-9 for e in ent)
    assert len(an["layers"]["similarity"]) == 3 and os.path.getsize(tmp_path / "an" / "entropy.png") > 1000
    assert sorted(os.listdir(model)) == before, "nothing is written into the model folder"
