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

import jax
import ml_collections
import numpy as np

from resformer_jax.config import ConfigError, base_config
from resformer_jax.model.config import ModelConfig


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
        except Exception as e:
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
    m.norm_eps = float(hf.get("rms_norm_eps", 1e-5))
    read_rope(hf, m)
    refuse_unsupported(hf, m)
    m.value_residual, m.scan_layers, m.attention_impl = hf.get("value_residual", "none"), False, "auto"
    if m.value_residual not in ("none", "resformer", "svformer"):
        raise HFError(f"value_residual {m.value_residual!r} in config.json is not one this project exports")
    if m.value_residual == "resformer":
        m.resformer_lambdas = hf.get("resformer_lambdas", "fixed")
        table = np.asarray(hf.get("resformer_fixed_lambdas") or [[0.5, 0.5]], np.float64)
        if m.resformer_lambdas == "sparse":
            m.sparse_layers = tuple(int(i) + 2 for i in np.nonzero(table[:, 0])[0])
            m.sparse_lambda = float(table[table[:, 0] != 0, 0][0]) if m.sparse_layers else 5.0
        else:
            m.lambda_init = (float(table[0, 0]), float(table[0, 1]))
    if int(hf.get("head_dim") or m.d_model // m.num_heads) != m.d_model // m.num_heads:
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
    params = {
        "embed": {"embedding": embed},
        "final_norm": {"scale": get("model.norm.weight", (E,))},
        "lm_head": {"kernel": (get("lm_head.weight", (V, E)) if "lm_head.weight" in t else embed).T.copy()},
    }
    for key in ("lambda_logits", "lambda_scale"):
        if f"model.{key}" in t:
            params[key] = np.asarray(t[f"model.{key}"], np.float32)
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
        if i == 0 or m.value_residual != "svformer":  # Eq. 10: SVFormer's layers >= 2 have no W_V
            params[f"layer_{i + 1}"]["attn"]["value"] = {
                "kernel": get(p + "self_attn.v_proj.weight", (K * D, E)).reshape(K, D, E).transpose(2, 0, 1)
            }
        for name in ("lambda1", "lambda2"):
            if p + f"self_attn.{name}" in t:
                params[f"layer_{i + 1}"][name] = np.asarray(t[p + f"self_attn.{name}"], np.float32)
    return m, params


# ----------------------------------------------------------------------------- export


EXPORTABLE = {
    "value_residual": ("none", "resformer", "svformer"),
    "value_source": ("first",),
    "residual_on": ("v",),
    "mapping": ("attention",),
    "cla_share_every": (1,),
    "svformer_share": ("v",),
    "denseformer": (False,),
    "arch": ("llama",),
}
SHARD_BYTES = 5 * 2**30


def unrolled(params: dict, num_layers: int) -> dict:
    """Scanned parameters ({'layers': {'block': [L-1, ...]}}) as one subtree per layer ({'layer_n': ...})."""
    if "layers" not in params:
        return dict(params)
    out = {k: v for k, v in params.items() if k != "layers"}
    stacked = params["layers"]["block"]
    for i in range(num_layers - 1):
        out[f"layer_{i + 2}"] = jax.tree.map(lambda x, i=i: np.asarray(x)[i], stacked)
    return out


def hf_tensors(m, params: dict) -> dict[str, np.ndarray]:
    """This project's parameters as HF Llama tensors ([out, in] Linear weights); SVFormer layers >= 2 have no
    v_proj; learnable lambdas become `self_attn.lambda1/lambda2` scalars (and `model.lambda_logits`,
    `model.lambda_scale` for learnable_plus)."""
    for field, allowed in EXPORTABLE.items():
        value = getattr(ModelConfig.of(m), field)
        if value not in allowed:
            raise HFError(f"config.model.{field}={value!r} has no Hugging Face export; exportable: {allowed}")
    p = unrolled(jax.tree.map(lambda x: np.asarray(x, np.float32), params), m.num_layers)
    E = m.d_model
    t = {
        "model.embed_tokens.weight": p["embed"]["embedding"],
        "model.norm.weight": p["final_norm"]["scale"],
        "lm_head.weight": p["lm_head"]["kernel"].T if "lm_head" in p else p["embed"]["embedding"],
    }  # tied: the table
    for key in ("lambda_logits", "lambda_scale"):
        if key in p:
            t[f"model.{key}"] = np.asarray(p[key], np.float32)
    for n in range(1, m.num_layers + 1):
        lp, pre = p[f"layer_{n}"], f"model.layers.{n - 1}."
        a = lp["attn"]
        t[pre + "input_layernorm.weight"] = lp["attn_norm"]["scale"]
        t[pre + "post_attention_layernorm.weight"] = lp["mlp_norm"]["scale"]
        for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            if ours in a:
                k = a[ours]["kernel"]  # [E, N, D]
                t[pre + f"self_attn.{theirs}.weight"] = k.transpose(1, 2, 0).reshape(-1, E)
        t[pre + "self_attn.o_proj.weight"] = a["out"]["kernel"].reshape(-1, E).T
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            t[pre + f"mlp.{theirs}.weight"] = lp["mlp"][ours]["kernel"].T
        for name in ("lambda1", "lambda2"):
            if name in lp:
                t[pre + f"self_attn.{name}"] = np.asarray(lp[name], np.float32)
    return {k: np.array(v, order="C") for k, v in t.items()}  # (ascontiguousarray would make scalars 1-d)


def hf_config(m, tokenizer_meta: dict | None = None) -> dict:
    """config.json: a LlamaConfig; a value-residual model adds its fields and the auto_map of modeling_resformer.py."""
    from resformer_jax.model.lambdas import fixed_lambdas

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_dim,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads or m.num_heads,
        "num_hidden_layers": m.num_layers,
        "head_dim": m.d_model // m.num_heads,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "max_position_embeddings": m.max_seq_len,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": m.init_std,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if tokenizer_meta:
        cfg.update(bos_token_id=tokenizer_meta.get("eot_id"), eos_token_id=tokenizer_meta.get("eot_id"))
    from resformer_jax.config import ties_embeddings

    cfg["tie_word_embeddings"] = ties_embeddings(m)
    rope_type = ModelConfig.of(m).rope_type
    if rope_type != "default":  # an imported Llama 3.1 (llama3) or linear-scaled model, written back as HF writes it
        cfg["rope_scaling"] = {"rope_type": rope_type, "factor": m.rope_factor}
        if rope_type == "llama3":
            cfg["rope_scaling"].update(
                low_freq_factor=m.rope_low_freq_factor,
                high_freq_factor=m.rope_high_freq_factor,
                original_max_position_embeddings=m.rope_original_max_position,
            )
    plans = exported_plans(m)
    if rope_type != "default" and any(mix != "own" for mix in plans["layer_value_mix"]):
        raise HFError(
            f"a value-residual model with rope_type={rope_type!r} has no Hugging Face export: "
            "modeling_resformer.py computes plain RoPE only"
        )
    if any(mix != "own" for mix in plans["layer_value_mix"]):
        cfg["architectures"] = ["ResFormerLlamaForCausalLM"]
        cfg["use_cache"] = False  # modeling_resformer.py recomputes the prefix (no KV cache)
        cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_resformer.ResFormerLlamaForCausalLM"}
        cfg["value_residual"] = m.value_residual
        cfg["resformer_lambdas"] = m.resformer_lambdas
        cfg["resformer_fixed_lambdas"] = fixed_lambdas(m).tolist()  # (l1, l2) of layers 2..N when not learned
        cfg.update(plans)  # what each layer computes, as the model's plan says: modeling_resformer.py reads these
    return cfg


# How each layer's attended value is formed, by the plan's equation function (model/attention.py), as
# config.json names it for modeling_resformer.py: V_n | V_1 | l1 V_1 + l2 V_n.
_EXPORTED_MIXES = {"eq1_own_value": "own", "eq10_svformer_value": "first", "eq7_resformer_value": "lambda_mix"}


def exported_plans(m) -> dict:
    """The per-layer plan as config.json carries it: which layers own W_V and how each forms the value it attends
    over. A plan this format cannot express (NeuTRENO, Q/K residuals, other mappings or value sources, shared
    Q/K, anchors, CLA) is refused by name: an export is exact or it stops."""
    from resformer_jax.model.attention import plan_layer

    owns, mixes = [], []
    for n in range(1, m.num_layers + 1):
        p = plan_layer(m, n)
        unsupported = [
            name
            for name, bad in (
                ("NeuTRENO (Eq. 8)", p.neutreno != 0.0),
                (f"residual_on={p.residual_on}", p.residual_on is not None),
                (f"mapping={p.mapping}", p.mapping != "attention"),
                (f"value_source={p.value_source}", p.value_source not in (None, "first")),
                (f"query={p.query}", p.query != "own"),
                (f"key={p.key}", p.key != "own"),
                (f"value={p.value}", p.value not in ("own", "none")),
                ("an SVFormer anchor", p.anchor),
                (f"value mix {p.mix.__name__}", p.mix.__name__ not in _EXPORTED_MIXES),
            )
            if bad
        ]
        if unsupported:
            raise HFError(
                f"layer {n} uses {', '.join(unsupported)}, which the Hugging Face export cannot express; "
                "export runs of none, resformer or svformer (GQA and ResFormer's lambda modes included)"
            )
        owns.append(p.owns[2])
        mixes.append(_EXPORTED_MIXES[p.mix.__name__])
    return {"layer_owns_value": owns, "layer_value_mix": mixes}


def export_params(
    m,
    params: dict,
    out: str,
    dtype: str = "float32",
    tokenizer_meta: dict | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> dict:
    """Writes config.json, generation_config.json and model.safetensors (sharded above `shard_bytes`, with
    model.safetensors.index.json) into `out`; a value-residual model also gets modeling_resformer.py."""
    from safetensors.numpy import save_file

    os.makedirs(out, exist_ok=True)
    np_dtype = {"float32": np.float32, "bfloat16": None, "float16": np.float16}[dtype]
    tensors = hf_tensors(m, params)
    if dtype == "bfloat16":
        import ml_dtypes

        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    else:
        tensors = {k: v.astype(np_dtype) for k, v in tensors.items()}
    names, shards, cur, size = sorted(tensors), [], {}, 0
    for n in names:
        if cur and size + tensors[n].nbytes > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[n] = tensors[n]
        size += tensors[n].nbytes
    shards.append(cur)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out, "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, part in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(part, os.path.join(out, fname), metadata=meta)
            weight_map.update({n: fname for n in part})
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(
                {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map},
                f,
                indent=1,
            )
    cfg = hf_config(m, tokenizer_meta)
    cfg["torch_dtype"] = dtype
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    gen = {"_from_model_config": True}
    if tokenizer_meta and tokenizer_meta.get("eot_id") is not None:
        gen.update(bos_token_id=tokenizer_meta["eot_id"], eos_token_id=tokenizer_meta["eot_id"])
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=1)
    if m.value_residual != "none":
        import shutil

        shutil.copyfile(
            os.path.join(os.path.dirname(__file__), "modeling_resformer.py"), os.path.join(out, "modeling_resformer.py")
        )
    return cfg
