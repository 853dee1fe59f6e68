"""Export a run to Hugging Face format.

  resformer export --workdir=RUN --out=DIR [--step=S] [--dtype=float32|bfloat16] [--overwrite]

Writes DIR/config.json, model.safetensors (sharded above 5 GiB, with model.safetensors.index.json),
generation_config.json and the run's tokenizer (tokenizer.json, tokenizer_config.json). A vanilla run is a
standard LlamaForCausalLM; ResFormer and SVFormer runs (GQA and learned lambdas included) carry the same
tensors (SVFormer's layers >= 2 without v_proj) and modeling_resformer.py for trust_remote_code=True.
Read back with resformer_jax.hf.llama_import.load_hf_llama (analysis, initialisation).
"""

from __future__ import annotations

import json
import sys

from absl import flags

from resformer_jax.commands import common as cli

flags.DEFINE_string("workdir", None, "Run directory.", required=True)
flags.DEFINE_string("out", None, "Output folder.", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step (default: newest).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Tensor dtype in the files.")
flags.DEFINE_bool(
    "overwrite",
    False,
    "Replace an earlier export in --out (a run directory or a folder holding anything else is never written into).",
)
FLAGS = flags.FLAGS


def main(argv):
    cli.start()
    with cli.exit_on_user_error():
        from resformer_jax.hf.run_export import check_target, export_run
        from resformer_jax.load import load_run
        from resformer_jax.rundir import RunDir

        run = RunDir(FLAGS.workdir)
        replacing = check_target(run, FLAGS.out, FLAGS.overwrite)  # before the load: a bad --out costs no restore
        r = export_run(run, load_run(run.workdir, FLAGS.step), FLAGS.out, FLAGS.dtype, replacing)
    print(json.dumps(r))
    if not r["tokenizer"]:
        print(f"note: {FLAGS.workdir} has no tokenizer.json (synthetic data); the export has none", file=sys.stderr)


def cli_main():
    cli.run_app(main, sys.modules[__name__])
