"""Export a run to Hugging Face format.

  python -m resformer_jax.export --workdir=RUN --out=DIR [--step=S] [--dtype=float32|bfloat16]

Writes DIR/config.json, model.safetensors (sharded above 5 GiB, with model.safetensors.index.json),
generation_config.json and the run's tokenizer (tokenizer.json, tokenizer_config.json). A vanilla run is a
standard LlamaForCausalLM; ResFormer and SVFormer runs (GQA and learned lambdas included) carry the same
tensors (SVFormer's layers >= 2 without v_proj) and modeling_resformer.py for trust_remote_code=True.
Read back with resformer_jax.hf.load_hf_llama (analysis, initialisation).
"""
from __future__ import annotations

import json
import os
import sys

from absl import app, flags

flags.DEFINE_string("workdir", None, "Run directory.", required=True)
flags.DEFINE_string("out", None, "Output folder.", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step (default: newest).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Tensor dtype in the files.")
FLAGS = flags.FLAGS


def export_run(workdir: str, out: str, step: int | None = None, dtype: str = "float32") -> dict:
    import jax
    from resformer_jax.hf import export_params
    from resformer_jax.train.setup import load_run
    from resformer_jax import storage
    cfg, params, step = load_run(workdir, step)
    tok = storage.run_tokenizer(workdir)
    meta = None
    with storage.staged_dir(out) as local:  # safetensors writes local files; a cloud --out is uploaded after
        if tok is not None:
            eot = tok.token_to_id("<|endoftext|>")
            meta = {"eot_id": eot}
            storage.copy_file(storage.run_path(workdir) / "tokenizer.json", os.path.join(local, "tokenizer.json"))
            special = "<|endoftext|>" if eot is not None else None
            with open(os.path.join(local, "tokenizer_config.json"), "w") as f:
                json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.model.max_seq_len,
                           "bos_token": special, "eos_token": special, "unk_token": special,
                           "clean_up_tokenization_spaces": False}, f, indent=1)
        hf_cfg = export_params(cfg.model, jax.device_get(params), local, dtype, meta)
    return {"step": step, "out": out, "architectures": hf_cfg["architectures"], "tokenizer": meta is not None}


def main(argv):
    from resformer_jax import cli
    cli.start()
    with cli.exit_on_user_error():
        r = export_run(FLAGS.workdir, FLAGS.out, FLAGS.step, FLAGS.dtype)
    print(json.dumps(r))
    if not r["tokenizer"]:
        print(f"note: {FLAGS.workdir} has no tokenizer.json (synthetic data); the export has none", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
