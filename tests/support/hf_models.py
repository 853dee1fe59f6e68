"""A tiny Llama-layout Hugging Face checkpoint, written for the import tests."""

import json
import os

import numpy as np

TEXT = "The quick brown fox jumps over the lazy dog. " * 40 + "def main():\n    return 42\n" * 30


def write_tiny_llama(folder, tie=False, kv=2, shards=1, extra=None):
    """A tiny Llama-layout checkpoint: config.json, safetensors (sharded if asked), a trained tokenizer.json."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [TEXT],
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    tok.save(os.path.join(folder, "tokenizer.json"))
    V, E, H, F, L = 320, 32, 4, 48, 3
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": V,
        "hidden_size": E,
        "intermediate_size": F,
        "num_attention_heads": H,
        "num_key_value_heads": kv,
        "num_hidden_layers": L,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": tie,
    }
    cfg.update(extra or {})
    cfg = {k: v for k, v in cfg.items() if v is not None}
    rng = np.random.default_rng(0)
    w = lambda *s: (rng.normal(size=s) * 0.1).astype(np.float32)
    D = E // H
    sd = {"model.embed_tokens.weight": w(V, E), "model.norm.weight": 1 + w(E)}
    if not tie:
        sd["lm_head.weight"] = w(V, E)
    for i in range(L):
        p = f"model.layers.{i}."
        sd.update(
            {
                p + "input_layernorm.weight": 1 + w(E),
                p + "post_attention_layernorm.weight": 1 + w(E),
                p + "self_attn.q_proj.weight": w(H * D, E),
                p + "self_attn.k_proj.weight": w(kv * D, E),
                p + "self_attn.v_proj.weight": w(kv * D, E),
                p + "self_attn.o_proj.weight": w(E, H * D),
                p + "mlp.gate_proj.weight": w(F, E),
                p + "mlp.up_proj.weight": w(F, E),
                p + "mlp.down_proj.weight": w(E, F),
            }
        )
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
