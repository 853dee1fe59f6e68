"""Train (default), or print a model summary.

python -m resformer_jax.main                      # the offline demo
python -m resformer_jax.main --config=configs/resformer_82m.py --workdir=RUN
python -m resformer_jax.main --config=configs/resformer_468m.py --mode=summary

Any field of the config from the command line: --config.SECTION.FIELD=VALUE, e.g. --config.train.steps=200
--config.model.value_residual=svformer --config.data.path=/data/sp20b. The sections are model, data, train, eval,
mesh, distributed, watchdog and checkpoint; their fields, defaults and meanings are in resformer_jax/config.py and
resformer_jax/model/config.py (docs/training.md). A misspelt field is refused, naming the nearest one.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from resformer_jax.commands import common

_DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "demo.py")
config_flags.DEFINE_config_file("config", _DEMO, "Config file (ml_collections get_config()).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, TensorBoard logs (default: runs/<config name>).")
flags.DEFINE_enum("mode", "train", ["train", "summary"], "train: pretrain; summary: print model facts as JSON.")
flags.DEFINE_string("coordinator_address", None, "Multi-host: coordinator host:port (auto on TPU pods and SLURM).")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: this process's id.")
FLAGS = flags.FLAGS


def main(argv):
    common.start()
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; fields are set as --config.section.field=value")
    cfg = FLAGS.config
    if FLAGS.mode == "summary":
        from resformer_jax.perf import summary
        from resformer_jax.resolve import AttentionChoice, resolve

        with common.exit_on_user_error():  # the attention impl as written: the summary counts, it runs nothing
            unprobed = AttentionChoice(cfg.model.attention_impl, {}, False)
            run = resolve(cfg, attention=unprobed, log=lambda m: print(m, file=sys.stderr))
        print(json.dumps(summary(run.cfg), default=list))
        return
    # training resolves the run once (resolve.resolve), after its cheap checks
    workdir = FLAGS.workdir or os.path.join(
        "runs",
        os.path.splitext(
            os.path.basename(FLAGS["config"].config_filename if hasattr(FLAGS["config"], "config_filename") else "demo")
        )[0],
    )
    from resformer_jax.commands.training import run

    hosts = {k: FLAGS[k].value for k in ("coordinator_address", "num_processes", "process_id")}
    sys.exit(run(cfg, workdir, **hosts))


def cli_main():
    common.check_config_flags(sys.argv, default_config=_DEMO)
    common.run_app(main, sys.modules[__name__])
