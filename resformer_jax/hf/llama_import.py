"""Hugging Face Llama-family checkpoints (Llama, Mistral; local safetensors files, nothing downloaded) as this
project's model: for analysis (the paper's Fig. 1 right and Fig. 15 right) and as an initialisation.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import ml_collections
import numpy as np
from etils import epath

from resformer_jax.config import ConfigError, base_config
from resformer_jax.model.config import ModelConfig
from resformer_jax.storage import is_remote


class HFError(ConfigError):
    """A Hugging Face checkpoint folder that cannot be read as a Llama-family model; the message says why."""


def is_export(path) -> bool:
    """Whether a folder holds a Hugging Face export (config.json with a model_type, and safetensors weights)."""
    path = epath.Path(path)
    cfg = path / "config.json"
    if not cfg.is_file() or not (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    ):
        return False
    try:
        return "model_type" in json.loads(cfg.read_text())
    except ValueError:
        return False


def read_safetensors(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of model.safetensors or of the shards listed in model.safetensors.index.json (a local folder or
    one on object storage)."""
    index = epath.Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (epath.Path(folder) / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    out = {}
    for name in files:
        try:
            out.update(_read_tensors(epath.Path(folder) / name))
        except Exception as e:
            raise HFError(f"{folder}/{name} does not read as safetensors ({type(e).__name__}: {e})") from None
    return out


def _read_tensors(path: epath.Path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors; one on object storage through a local copy (safetensors reads files)."""
    from safetensors.numpy import load_file

    if not is_remote(path):
        return load_file(str(path))
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(path.read_bytes())
        f.flush()
        return load_file(f.name)


# What a LlamaConfig must state; the rest has transformers' defaults.
REQUIRED_FIELDS = ("vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size")


def llama_model_config(hf: dict) -> ml_collections.ConfigDict:
    """This project's model config for an HF LlamaConfig / MistralConfig dict."""
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    if hf.get("model_type") not in ("llama", "mistral") and not any("Llama" in a or "Mistral" in a for a in archs):
        raise HFError(f"model_type {hf.get('model_type')!r} ({archs}) is not a Llama-family model")
    missing = [k for k in REQUIRED_FIELDS if k not in hf]
    if missing:
        raise HFError(f"config.json lacks {', '.join(missing)}: not a complete Llama config (re-export the folder)")
    m = base_config().model
    m.vocab_size = int(hf["vocab_size"])
    m.num_layers = int(hf["num_hidden_layers"])
    m.num_heads = int(hf["num_attention_heads"])
    m.num_kv_heads = int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    m.d_model = int(hf["hidden_size"])
    m.ffn_dim = int(hf["intermediate_size"])
    m.max_seq_len = int(hf.get("max_position_embeddings", 4096))
    m.norm_eps = float(hf.get("rms_norm_eps", 1e-5))
    read_rope(hf, m)
    refuse_unsupported(hf, m)
    m.value_residual, m.scan_layers, m.attention_impl = hf.get("value_residual", "none"), False, "auto"
    if m.value_residual not in ("none", "resformer", "svformer", "skipv1"):
        raise HFError(f"value_residual {m.value_residual!r} in config.json is not one this project exports")
    if m.value_residual == "skipv1":
        m.skipv1_reused_heads = int(hf.get("skipv1_reused_heads", -1))
    m.value_embeddings = int(hf.get("value_embeddings", 0))
    m.value_embedding_gate = bool(hf.get("value_embedding_gate", False))
    if m.value_residual == "resformer":
        m.resformer_lambdas = hf.get("resformer_lambdas", "fixed")
        table = np.asarray(hf.get("resformer_fixed_lambdas") or [[0.5, 0.5]], np.float64)
        if m.resformer_lambdas == "sparse":
            m.sparse_layers = tuple(int(i) + 2 for i in np.nonzero(table[:, 0])[0])
            m.sparse_lambda = float(table[table[:, 0] != 0, 0][0]) if m.sparse_layers else 5.0
        else:
            m.lambda_init = (float(table[0, 0]), float(table[0, 1]))
    if int(hf.get("head_dim") or ModelConfig.of(m).head_dim) != ModelConfig.of(m).head_dim:
        raise HFError("head_dim != hidden_size / num_attention_heads is not supported")
    return m


def read_rope(hf: dict, m) -> None:
    """RoPE's theta and scaling from either layout: transformers 4's top-level `rope_theta` and `rope_scaling`, or
    transformers 5's `rope_parameters: {rope_type, rope_theta, ...}`. Plain, linear and llama3 (Llama 3.1) RoPE
    are computed exactly; any other type stops the import by name."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if isinstance(params, dict) and params and not scaling:
        scaling = params
    theta = hf.get("rope_theta", params.get("rope_theta") if isinstance(params, dict) else None)
    m.rope_theta = float(theta if theta is not None else 10000.0)
    kind = (scaling.get("rope_type") or scaling.get("type") or "default") if isinstance(scaling, dict) else "?"
    if kind == "default":
        return
    if kind not in ("linear", "llama3"):
        raise HFError(
            f"RoPE type {kind!r} ({scaling}) is not implemented (plain, linear and llama3 are); the import "
            "stops rather than compute other positions than the model was trained with"
        )
    m.rope_type, m.rope_factor = kind, float(scaling["factor"])
    if kind == "llama3":
        m.rope_low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        m.rope_high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        m.rope_original_max_position = int(scaling.get("original_max_position_embeddings", 8192))


def refuse_unsupported(hf: dict, m) -> None:
    """Every config field that changes the computation and is not implemented stops the import, by name: an import
    is exact or it does not happen. A sliding window shorter than the context caps max_seq_len at the window
    (sequences up to it attend exactly as the model does)."""
    bad = []
    if hf.get("attention_bias"):
        bad.append("attention_bias=true (biases on q/k/v/o)")
    if hf.get("mlp_bias"):
        bad.append("mlp_bias=true")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        bad.append(f"hidden_act={hf['hidden_act']!r} (SwiGLU with SiLU only)")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        bad.append(f"partial_rotary_factor={hf['partial_rotary_factor']}")
    if hf.get("qk_norm") or hf.get("use_qk_norm"):
        bad.append("q/k norms")
    if bad:
        raise HFError(
            f"config.json asks for {', '.join(bad)}, which this project does not implement; the import "
            "stops rather than compute something else than the checkpoint's model"
        )
    window = hf.get("sliding_window")
    if window and hf.get("use_sliding_window", True) is not False and int(window) < m.max_seq_len:
        m.max_seq_len = int(window)


def load_hf_llama(folder: str, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(typed model config, unrolled parameter tree) of an HF Llama/Mistral checkpoint folder (local or on object
    storage); the compute dtype `dtype`, or with "auto" the folder's torch_dtype (as vLLM's --dtype=auto; float32
    where it names none)."""
    cfg_path = epath.Path(folder) / "config.json"
    if not cfg_path.is_file():
        raise HFError(f"{folder} has no config.json: not a Hugging Face model folder")
    hf = json.loads(cfg_path.read_text())
    m = llama_model_config(hf)
    named = hf.get("torch_dtype") if hf.get("torch_dtype") in ("float32", "bfloat16", "float16") else "float32"
    m.dtype = named if dtype == "auto" else dtype
    t = read_safetensors(folder)
    E, H, K, D = m.d_model, m.num_heads, m.num_kv_heads, ModelConfig.of(m).head_dim

    def get(name, shape):
        if name not in t:
            raise HFError(f"{folder}: tensor {name} is missing")
        x = np.asarray(t[name], np.float32)
        if x.shape != shape:
            raise HFError(f"{folder}: {name} has shape {x.shape}, expected {shape}")
        return x

    V, F = m.vocab_size, m.ffn_dim
    embed = get("model.embed_tokens.weight", (V, E))
    params: dict[str, Any] = {
        "embed": {"embedding": embed},
        "final_norm": {"scale": get("model.norm.weight", (E,))},
        "lm_head": {"kernel": (get("lm_head.weight", (V, E)) if "lm_head.weight" in t else embed).T.copy()},
    }
    for key in ("lambda_logits", "lambda_scale"):
        if f"model.{key}" in t:
            params[key] = np.asarray(t[f"model.{key}"], np.float32)
    for j in range(m.value_embeddings):
        params[f"value_embed_{j}"] = {"embedding": get(f"model.value_embeds.{j}.weight", (V, K * D))}
    value_heads = hf.get("layer_value_heads") or [K] * m.num_layers
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        params[f"layer_{i + 1}"] = {
            "attn_norm": {"scale": get(p + "input_layernorm.weight", (E,))},
            "mlp_norm": {"scale": get(p + "post_attention_layernorm.weight", (E,))},
            "attn": {
                "query": {"kernel": get(p + "self_attn.q_proj.weight", (H * D, E)).reshape(H, D, E).transpose(2, 0, 1)},
                "key": {"kernel": get(p + "self_attn.k_proj.weight", (K * D, E)).reshape(K, D, E).transpose(2, 0, 1)},
                "out": {"kernel": get(p + "self_attn.o_proj.weight", (E, H * D)).T.reshape(H, D, E)},
            },
            "mlp": {
                "gate": {"kernel": get(p + "mlp.gate_proj.weight", (F, E)).T},
                "up": {"kernel": get(p + "mlp.up_proj.weight", (F, E)).T},
                "down": {"kernel": get(p + "mlp.down_proj.weight", (E, F)).T},
            },
        }
        attn, Kv = params[f"layer_{i + 1}"]["attn"], int(value_heads[i])
        if Kv and (i == 0 or m.value_residual != "svformer"):  # Eq. 10: SVFormer's layers >= 2 have no W_V
            attn["value"] = {
                "kernel": get(p + "self_attn.v_proj.weight", (Kv * D, E)).reshape(Kv, D, E).transpose(2, 0, 1)
            }
        for theirs, ours in (("lambda1", "lambda1"), ("lambda2", "lambda2"), ("convex_lambda", "lambda")):
            if p + f"self_attn.{theirs}" in t:
                params[f"layer_{i + 1}"][ours] = np.asarray(t[p + f"self_attn.{theirs}"], np.float32)
        for gate in ("value_gate", "ve_gate"):
            if p + f"self_attn.{gate}.weight" in t:
                attn[gate] = {"kernel": get(p + f"self_attn.{gate}.weight", (K, E)).T.copy()}
        if p + "self_attn.ve_lambdas" in t:
            attn["ve_lambdas"] = get(p + "self_attn.ve_lambdas", (2,))
    return ModelConfig.of(m), params  # a foreign checkpoint's config typed here, at the edge


# ----------------------------------------------------------------------------- export
