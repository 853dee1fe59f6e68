"""This project's parameters and config written as a Hugging Face model folder: tensors in HF Llama's layout
(the inverse of llama_import.py's mapping), config.json with the per-layer plan, sharded safetensors. A vanilla run
is a standard LlamaForCausalLM; ResFormer and SVFormer add modeling_resformer.py (run_export.py writes the folder)."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from resformer_jax.hf.llama_import import HFError
from resformer_jax.model import attention as eq
from resformer_jax.model.attention import plan_layer
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.lambdas import fixed_lambdas
from resformer_jax.model.transformer import unrolled_params

EXPORTABLE = {
    "value_residual": ("none", "resformer", "svformer", "skipv1"),
    "resformer_lambdas": ("fixed", "learnable", "learnable_plus", "sparse", "convex", "gated"),
    "value_source": ("first",),
    "residual_on": ("v",),
    "mapping": ("attention",),
    "cla_share_every": (1,),
    "svformer_share": ("v",),
    "denseformer": (False,),
    "arch": ("llama",),
}
SHARD_BYTES = 5 * 2**30


def hf_tensors(m: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """This project's parameters as HF Llama tensors ([out, in] Linear weights); SVFormer layers >= 2 have no
    v_proj (SkipV1Former's have K - r heads); learnable lambdas become `self_attn.lambda1/lambda2` scalars (and
    `model.lambda_logits`, `model.lambda_scale` for learnable_plus; `self_attn.convex_lambda` for convex), the
    gate `self_attn.value_gate.weight`, value embeddings `model.value_embeds.J.weight` with each layer's
    `self_attn.ve_lambdas` or `self_attn.ve_gate.weight`."""
    for field, allowed in EXPORTABLE.items():
        value = getattr(m, field)
        if value not in allowed:
            raise HFError(f"config.model.{field}={value!r} has no Hugging Face export; exportable: {allowed}")
    p = unrolled_params(jax.tree.map(lambda x: np.asarray(x, np.float32), params), m.num_layers)
    E = m.d_model
    t = {
        "model.embed_tokens.weight": p["embed"]["embedding"],
        "model.norm.weight": p["final_norm"]["scale"],
        "lm_head.weight": p["lm_head"]["kernel"].T if "lm_head" in p else p["embed"]["embedding"],
    }  # tied: the table
    for key in ("lambda_logits", "lambda_scale"):
        if key in p:
            t[f"model.{key}"] = np.asarray(p[key], np.float32)
    for j in range(m.value_embeddings):
        t[f"model.value_embeds.{j}.weight"] = p[f"value_embed_{j}"]["embedding"]
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
        for ours, theirs in (("lambda1", "lambda1"), ("lambda2", "lambda2"), ("lambda", "convex_lambda")):
            if ours in lp:
                t[pre + f"self_attn.{theirs}"] = np.asarray(lp[ours], np.float32)
        for gate in ("value_gate", "ve_gate"):  # [E, K] -> Linear [K, E]
            if gate in a:
                t[pre + f"self_attn.{gate}.weight"] = a[gate]["kernel"].T
        if "ve_lambdas" in a:
            t[pre + "self_attn.ve_lambdas"] = np.asarray(a["ve_lambdas"], np.float32)
    return {k: np.array(v, order="C") for k, v in t.items()}  # (ascontiguousarray would make scalars 1-d)


def hf_config(m: ModelConfig, tokenizer_meta: dict | None = None) -> dict:
    """config.json: a LlamaConfig; a value-residual model adds its fields and the auto_map of modeling_resformer.py."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_dim,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads or m.num_heads,
        "num_hidden_layers": m.num_layers,
        "head_dim": m.head_dim,
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

    cfg["tie_word_embeddings"] = m.tie_embeddings
    rope_type = m.rope_type
    if rope_type != "default":  # an imported Llama 3.1 (llama3) or linear-scaled model, written back as HF writes it
        scaling: dict[str, Any] = {"rope_type": rope_type, "factor": m.rope_factor}
        cfg["rope_scaling"] = scaling
        if rope_type == "llama3":
            scaling.update(
                low_freq_factor=m.rope_low_freq_factor,
                high_freq_factor=m.rope_high_freq_factor,
                original_max_position_embeddings=m.rope_original_max_position,
            )
    plans = exported_plans(m)
    twin = any(mix != "own" for mix in plans["layer_value_mix"]) or any(t >= 0 for t in plans["layer_value_table"])
    if rope_type != "default" and twin:
        raise HFError(
            f"a value-residual model with rope_type={rope_type!r} has no Hugging Face export: "
            "modeling_resformer.py computes plain RoPE only"
        )
    if twin:
        cfg["architectures"] = ["ResFormerLlamaForCausalLM"]
        cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_resformer.ResFormerLlamaForCausalLM"}
        cfg["value_residual"] = m.value_residual
        cfg["resformer_lambdas"] = m.resformer_lambdas
        cfg["skipv1_reused_heads"] = m.skipv1_heads if m.value_residual == "skipv1" else 0
        cfg["value_embeddings"] = int(m.value_embeddings)
        cfg["value_embedding_gate"] = bool(m.value_embedding_gate)
        cfg["resformer_fixed_lambdas"] = fixed_lambdas(m).tolist()  # (l1, l2) of layers 2..N when not learned
        cfg.update(plans)  # what each layer computes, as the model's plan says: modeling_resformer.py reads these
    return cfg


# How each layer's attended value is formed, by the plan's equation function (model/attention.py), as
# config.json names it for modeling_resformer.py: V_n | V_1 | l1 V_1 + l2 V_n | SkipV1's heads | the gated lerp.
def _exported_mix(mix) -> str | None:
    """config.json's name of a plan's value mix (its `mix` field, an equation function), or None."""
    names = (
        (eq.eq1_own_value, "own"),
        (eq.eq10_svformer_value, "first"),
        (eq.eq7_resformer_value, "lambda_mix"),
        (eq.skipv1_value, "skipv1"),
        (eq.gated_value, "gated"),
    )
    return next((name for f, name in names if f is mix), None)


def exported_plans(m: ModelConfig) -> dict:
    """The per-layer plan as config.json carries it: which layers own W_V (and with how many heads), how each forms
    the value it attends over, and which value-embedding table it adds (-1: none). A plan this format cannot
    express (NeuTRENO, Q/K residuals, other mappings or value sources, shared Q/K, anchors, CLA) is refused by
    name: an export is exact or it stops."""
    owns, heads, mixes, tables = [], [], [], []
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
                (f"value mix {p.mix.__name__}", _exported_mix(p.mix) is None),
            )
            if bad
        ]
        if unsupported:
            raise HFError(
                f"layer {n} uses {', '.join(unsupported)}, which the Hugging Face export cannot express; "
                "export runs of none, resformer, svformer or skipv1 (GQA, ResFormer's lambda modes and value "
                "embeddings included)"
            )
        owns.append(p.owns[2])
        heads.append((p.own_value_heads or m.kv_heads) if p.owns[2] else 0)
        mixes.append(_exported_mix(p.mix))
        tables.append(p.value_table)
    return {
        "layer_owns_value": owns,
        "layer_value_heads": heads,
        "layer_value_mix": mixes,
        "layer_value_table": tables,
    }


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
    cur: dict[str, np.ndarray] = {}
    names, shards, size = sorted(tensors), [], 0
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
    if "auto_map" in cfg:
        import shutil

        shutil.copyfile(
            os.path.join(os.path.dirname(__file__), "modeling_resformer.py"), os.path.join(out, "modeling_resformer.py")
        )
    return cfg
