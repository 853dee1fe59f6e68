"""Hugging Face Llama-family checkpoints (Llama, Mistral; local safetensors files, nothing downloaded) as this
project's model: for analysis (the paper's Fig. 1 right and Fig. 15 right) and as an initialisation.

  cfg, params = load_hf_llama("/models/Meta-Llama-3-8B")     # config.json + model.safetensors[.index.json]

The mapping, per layer (HF stores a Linear's weight as [out, in]):
  model.embed_tokens.weight [V, E]                -> embed/embedding [V, E]
  self_attn.{q,k,v}_proj.weight [N*D, E]          -> attn/{query,key,value}/kernel [E, N, D]
  self_attn.o_proj.weight [E, H*D]                -> attn/out/kernel [H, D, E]
  mlp.{gate,up}_proj.weight [F, E], down [E, F]   -> mlp/{gate,up}/kernel [E, F], mlp/down/kernel [F, E]
  input_layernorm / post_attention_layernorm      -> attn_norm / mlp_norm scale
  model.norm.weight, lm_head.weight [V, E]        -> final_norm scale, lm_head/kernel [E, V] (the embedding when tied)
HF Llama applies RoPE in the rotate-half convention (its q/k weights are stored permuted for it), which is
this project's convention too, so q and k need no permutation.
"""
from __future__ import annotations

import json
import os

import ml_collections
import numpy as np

from resformer_jax.config import ConfigError, base_config


class HFError(ConfigError):
    """A Hugging Face checkpoint folder that cannot be read as a Llama-family model; the message says why."""


def read_safetensors(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of model.safetensors or of the shards listed in model.safetensors.index.json."""
    from safetensors.numpy import load_file
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise HFError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    out = {}
    for name in files:
        try:
            out.update(load_file(os.path.join(folder, name)))
        except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
            raise HFError(f"{folder}/{name} does not read as safetensors ({type(e).__name__}: {e})") from None
    return out


def llama_model_config(hf: dict) -> ml_collections.ConfigDict:
    """This project's model config for an HF LlamaConfig / MistralConfig dict."""
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    if hf.get("model_type") not in ("llama", "mistral") and not any("Llama" in a or "Mistral" in a for a in archs):
        raise HFError(f"model_type {hf.get('model_type')!r} ({archs}) is not a Llama-family model")
    m = base_config().model
    m.vocab_size = int(hf["vocab_size"])
    m.num_layers = int(hf["num_hidden_layers"])
    m.num_heads = int(hf["num_attention_heads"])
    m.num_kv_heads = int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    m.d_model = int(hf["hidden_size"])
    m.ffn_dim = int(hf["intermediate_size"])
    m.max_seq_len = int(hf.get("max_position_embeddings", 4096))
    m.rope_theta = float(hf.get("rope_theta", 10000.0))
    m.norm_eps = float(hf.get("rms_norm_eps", 1e-5))
    m.value_residual, m.scan_layers, m.attention_impl = "none", False, "auto"
    if int(hf.get("head_dim") or m.d_model // m.num_heads) != m.d_model // m.num_heads:
        raise HFError("head_dim != hidden_size / num_attention_heads is not supported")
    if hf.get("rope_scaling"):
        raise HFError(f"rope_scaling {hf['rope_scaling']!r} is not supported (plain RoPE only)")
    return m


def load_hf_llama(folder: str, dtype: str = "float32") -> tuple[ml_collections.ConfigDict, dict]:
    """(model config, unrolled parameter tree) of a local HF Llama/Mistral checkpoint folder."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise HFError(f"{folder} has no config.json: not a Hugging Face model folder")
    with open(cfg_path) as f:
        hf = json.load(f)
    m = llama_model_config(hf)
    m.dtype = dtype
    t = read_safetensors(folder)
    E, H, K, D = m.d_model, m.num_heads, m.num_kv_heads, m.d_model // m.num_heads

    def get(name, shape):
        if name not in t:
            raise HFError(f"{folder}: tensor {name} is missing")
        x = np.asarray(t[name], np.float32)
        if x.shape != shape:
            raise HFError(f"{folder}: {name} has shape {x.shape}, expected {shape}")
        return x

    V, F = m.vocab_size, m.ffn_dim
    embed = get("model.embed_tokens.weight", (V, E))
    params = {"embed": {"embedding": embed}, "final_norm": {"scale": get("model.norm.weight", (E,))},
              "lm_head": {"kernel": (get("lm_head.weight", (V, E)) if "lm_head.weight" in t else embed).T.copy()}}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        params[f"layer_{i + 1}"] = {
            "attn_norm": {"scale": get(p + "input_layernorm.weight", (E,))},
            "mlp_norm": {"scale": get(p + "post_attention_layernorm.weight", (E,))},
            "attn": {
                "query": {"kernel": get(p + "self_attn.q_proj.weight", (H * D, E)).reshape(H, D, E).transpose(2, 0, 1)},
                "key": {"kernel": get(p + "self_attn.k_proj.weight", (K * D, E)).reshape(K, D, E).transpose(2, 0, 1)},
                "value": {"kernel": get(p + "self_attn.v_proj.weight", (K * D, E)).reshape(K, D, E).transpose(2, 0, 1)},
                "out": {"kernel": get(p + "self_attn.o_proj.weight", (E, H * D)).T.reshape(H, D, E)},
            },
            "mlp": {"gate": {"kernel": get(p + "mlp.gate_proj.weight", (F, E)).T},
                    "up": {"kernel": get(p + "mlp.up_proj.weight", (F, E)).T},
                    "down": {"kernel": get(p + "mlp.down_proj.weight", (E, F)).T}},
        }
    return m, params
