"""A run's checkpoint written as a Hugging Face model folder (what `python -m resformer_jax.export` does)."""
from __future__ import annotations

import json
import os

from resformer_jax import storage
from resformer_jax.hf import export_params
from resformer_jax.rundir import RunDir
from resformer_jax.train.setup import load_run


def export_run(workdir, out: str, step: int | None = None, dtype: str = "float32") -> dict:
    """Writes OUT/config.json, model.safetensors (+ index), generation_config.json and the run's tokenizer."""
    import jax
    run = RunDir(workdir)
    cfg, params, step = load_run(run.workdir, step)
    tok = run.tokenizer()
    meta = None
    with storage.staged_dir(out) as local:  # safetensors writes local files; a cloud --out is uploaded after
        if tok is not None:
            eot = tok.token_to_id("<|endoftext|>")
            meta = {"eot_id": eot}
            storage.copy_file(run.tokenizer_json, os.path.join(local, "tokenizer.json"))
            special = "<|endoftext|>" if eot is not None else None
            with open(os.path.join(local, "tokenizer_config.json"), "w") as f:
                json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.model.max_seq_len,
                           "bos_token": special, "eos_token": special, "unk_token": special,
                           "clean_up_tokenization_spaces": False}, f, indent=1)
        hf_cfg = export_params(cfg.model, jax.device_get(params), local, dtype, meta)
    return {"step": step, "out": out, "architectures": hf_cfg["architectures"], "tokenizer": meta is not None}
