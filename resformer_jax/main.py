"""The one entry point: train (default), or print a model summary.

  python -m resformer_jax.main                      # the offline demo
  python -m resformer_jax.main --config=configs/resformer_82m.py --workdir=RUN
  python -m resformer_jax.main --config=configs/resformer_468m.py --mode=summary
"""
from __future__ import annotations

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

_DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.py")
config_flags.DEFINE_config_file("config", _DEMO, "Config file (ml_collections get_config()).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, TensorBoard logs (default: runs/<config name>).")
flags.DEFINE_enum("mode", "train", ["train", "summary"], "train: pretrain; summary: print model facts as JSON.")
flags.DEFINE_string("coordinator_address", None, "Multi-host: coordinator host:port (auto on TPU pods and SLURM).")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: this process's id.")
FLAGS = flags.FLAGS


def summary(cfg) -> dict:
    from resformer_jax.metrics import model_flops
    from resformer_jax.model.decode import kv_cache_bytes_per_token
    f = model_flops(cfg.model, cfg.data.seq_len)
    out = {"params_total": f.params_total, "params_non_embedding": f.params_non_embedding,
           "flops_per_token": f.per_token, "flops_per_token_6n": f.per_token_6n}
    out["kv_cache_bytes_per_token"] = kv_cache_bytes_per_token(cfg.model)
    out["seq_len"] = cfg.data.seq_len
    out["tokens_per_step"] = cfg.train.global_batch * cfg.data.seq_len
    devices = cfg.mesh.num_devices or max(1, cfg.mesh.data) * max(1, cfg.mesh.fsdp)
    from resformer_jax.metrics import estimate_train_memory
    est = estimate_train_memory(cfg, devices)
    out["memory_estimate_per_device"] = {**est, "devices": devices, "target": cfg.mesh.target or None}
    if cfg.mesh.device_memory_limit_gb > 0:
        limit = cfg.mesh.device_memory_limit_gb * 2**30
        out["memory_estimate_per_device"].update(limit=int(limit), fits=est["total"] <= limit)
    out["model"] = cfg.model.to_dict()
    return out


def main(argv):
    from resformer_jax import cli
    cli.start()
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; fields are set as --config.section.field=value")
    from resformer_jax.config import validate
    cfg = FLAGS.config
    with cli.exit_on_user_error():
        validate(cfg)
    if FLAGS.mode == "summary":
        from resformer_jax.train.setup import resolve_dtype
        resolve_dtype(cfg, log=lambda m: print(m, file=sys.stderr))
        print(json.dumps(summary(cfg), default=list))
        return
    from resformer_jax.train.loop import run
    workdir = FLAGS.workdir or os.path.join("runs", os.path.splitext(os.path.basename(
        FLAGS["config"].config_filename if hasattr(FLAGS["config"], "config_filename") else "demo"))[0])
    sys.exit(run(cfg, workdir, coordinator_address=FLAGS.coordinator_address,
                 num_processes=FLAGS.num_processes, process_id=FLAGS.process_id))


if __name__ == "__main__":
    from resformer_jax import cli
    cli.check_config_flags(sys.argv, default_config=_DEMO)
    app.run(main)
