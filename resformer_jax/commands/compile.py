"""Compile a run's steps for a TPU slice or GPU nodes from this machine, and say whether it fits, before the queue.

  resformer compile --config=configs/resformer_468m.py --target=v5p-64
  resformer compile --config=configs/resformer_468m.py --target=h100x8 --nodes=4
  resformer compile --config=configs/seq_len/sweep.py:svformer,65536 --target=h100x8 --steps=train
  resformer compile --config=... --target=v5e-256 --config.train.microbatch=64 --config.model.remat=dots
  resformer compile --config=configs/resformer_468m.py --target=h100x8 --tune [--tune_write=FILE]
  resformer compile --scale_table=runs/scale_table [--scale_sizes=7b] [--scale_clusters=v5p-128]

Targets: v4-N, v5p-N (N TensorCores), v5e-N, v6e-N (N chips), libtpu's GEN:AxB[xC], --slices=S for multislice;
h100xN, h200xN, a100xN (N GPUs a node), --nodes=M. Any --config.a.b override works as in training.

Builds what a run builds on that hardware (train/setup.build: mesh, shardings, the platform's attention kernel,
dtype, remat, microbatch) and compiles the train step, the eval step and the decode steps with the target's own
compiler (libtpu, XLA:GPU with Triton), without the hardware. Prints per step and per device the arguments,
outputs, aliased bytes, temporaries and their total against the chip's memory, the compile time and the kernels
inside; then one JSON line on stdout. A step that does not fit ends the command with one line naming the
numbers and the knobs (exit 2). Every compiled step also carries its roofline: the compiled program's FLOPs and
HBM bytes by op, its per-op bound on step time and the MFU ceiling that implies (a bound, not a timing), and on
GPUs each Triton kernel's registers and spills from ptxas. --tune compiles the train step for the remat
policies, microbatches, scanned or unrolled layers and (several devices) fsdp vs data that a user would try, and
lists those that fit with 10% of memory to spare, best bound first; --tune_write=FILE writes the best one's
overrides there. --scale_table=DIR compiles the train step of every scale-out preset (configs/*_{1b,3b,7b}.py) for
each of its clusters, a process a row, keeps each row's JSON line in DIR (a rerun compiles only the rows missing
there) and prints docs/scaling-out.md's table.
Needs `pip install -e '.[aot]'`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from absl import flags
from ml_collections import config_flags

config_flags.DEFINE_config_file(
    "config", None, "Config file (ml_collections get_config()), as for training.", lock_config=True
)
flags.DEFINE_string("target", None, "Hardware: v5p-64, v5e-256, v4-8, v6e-8, v5e:2x4, h100x8, h200x8, a100x8, ...")
flags.DEFINE_integer("nodes", 1, "GPU targets: nodes of the --target's GPUs.")
flags.DEFINE_integer("slices", 1, "TPU targets: slices (multislice over DCN).")
flags.DEFINE_list("steps", ["train", "eval", "decode"], "Which steps to compile: train, eval, decode.")
flags.DEFINE_integer("decode_batch", 0, "Sequences decoded at once (default: one per batch shard of the mesh).")
flags.DEFINE_integer("prompt_len", 0, "Prompt tokens prefilled by the decode check (default: config.data.seq_len).")
flags.DEFINE_integer(
    "documents",
    0,
    "With data.document_mask: count the bounds on packed documents of this mean length (the kernels' skipped "
    "blocks, the model FLOPs of the pairs kept); 0: whole sequences, an upper bound.",
)
flags.DEFINE_bool(
    "tune",
    False,
    "Compile the train step for each remat policy, microbatch, layer layout and mesh layout and list "
    "those that fit, by their roofline bound.",
)
flags.DEFINE_string("tune_write", None, "--tune: write the best setting's --config overrides to this file.")
flags.DEFINE_string(
    "scale_table",
    None,
    "A folder: compile every scale-out preset for each of its clusters (the rows missing there), then print the "
    "table of docs/scaling-out.md.",
)
flags.DEFINE_list("scale_sizes", ["1b", "3b", "7b"], "--scale_table: the preset sizes.")
flags.DEFINE_list("scale_clusters", ["h100x8", "4xh100x8", "v5p-128", "v6e-64"], "--scale_table: the clusters.")
FLAGS = flags.FLAGS


def main(argv):
    from resformer_jax.commands import common

    if len(argv) > 1:
        common.fail(f"unexpected arguments {argv[1:]}; flags are --name=value")
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # not common.start(): the XLA flags are the target's (cli_main)
    with common.exit_on_user_error():
        from resformer_jax.compilation.aot import compile_for_target
        from resformer_jax.compilation.targets import parse_target

        if FLAGS.scale_table:
            return run_scale_table(FLAGS.scale_table, FLAGS.scale_sizes, FLAGS.scale_clusters)
        if FLAGS.target is None:
            raise common.ConfigFlagError("--target is required: the hardware to compile for, e.g. --target=h100x8")
        if FLAGS.config is None:
            raise common.ConfigFlagError(
                "--config is required: the run to compile, e.g. --config=configs/resformer_468m.py"
            )
        target = parse_target(FLAGS.target, nodes=FLAGS.nodes, slices=FLAGS.slices)
        log = lambda s: print(s, file=sys.stderr, flush=True)
        if FLAGS.tune:
            return run_tune(target, log)
        sizes = dict(decode_batch=FLAGS.decode_batch, prompt_len=FLAGS.prompt_len, document_len=FLAGS.documents)
        config = config_for_target(FLAGS["config"], target, log)
        report = compile_for_target(config, target, steps=tuple(FLAGS.steps), log=log, **sizes)
        for line in report.lines():
            print(line, file=sys.stderr)
        print(json.dumps(report.to_json()), flush=True)
        if not report.fits:
            common.fail(report.first_problem)


def config_for_target(flag, target, log):
    """--config as given; a scale-out preset named without its cluster (`--config=configs/svformer_7b.py`) compiles
    with the setting chosen for --target where it has one, as `configs/svformer_7b.py:v5p-128` would (for
    `--target=h100x8 --nodes=4`: `:4xh100x8`), the --config.* overrides applied after."""
    import inspect

    from resformer_jax.commands import common
    from resformer_jax.presets import cluster_for

    path = flag.config_filename
    cluster = cluster_for(target.name, target.nodes, target.num_slices)
    if cluster is None or ":" in path or not path.endswith(".py") or not os.path.isfile(path):
        return flag.value
    module = common.load_config_module(path)
    given = inspect.signature(module.get_config).parameters.get("cluster")
    if given is None or given.default == cluster:
        return flag.value
    config = module.get_config(cluster)
    config.update_from_flattened_dict(config_flags.get_override_values(flag))
    setting = f"compiling its {cluster} setting (mesh, microbatch, remat), as {path}:{cluster}"
    log(f"{path} is sized for {given.default}; {setting}")
    return config


def run_tune(target, log):
    from resformer_jax.commands import common
    from resformer_jax.compilation.aot import tune

    results = tune(FLAGS.config, target, log=log)
    fitting = [r for r in results if r.fits]
    print(f"{'setting':<90}{'GiB':>7}{'bound ms':>10}{'MFU ceiling':>13}", file=sys.stderr)
    for r in results:
        mem = f"{r.memory_bytes / 2**30:.1f}" if r.memory_bytes else "-"
        bound = f"{r.bound_s * 1e3:.1f}" if r.fits and r.bound_s else "does not fit"
        mfu = f"{r.mfu_ceiling:.3f}" if r.fits and r.mfu_ceiling else ""
        print(f"{r.flags():<90}{mem:>7}{bound:>10}{mfu:>13}", file=sys.stderr)
    print(json.dumps({"target": target.name, "results": [dataclasses.asdict(r) for r in results]}), flush=True)
    if not fitting:
        common.fail(
            "no setting fits the target with 10% of its memory to spare; shard over more devices (--nodes) or "
            "lower config.data.seq_len"
        )
    best = fitting[0]
    print(
        f"best for {target.hardware}: {best.flags()} (bound {best.bound_s * 1e3:.1f} ms, MFU ceiling "
        f"{best.mfu_ceiling:.3f}; a bound from the compiled program, not a timing)",
        file=sys.stderr,
    )
    if FLAGS.tune_write:
        with open(FLAGS.tune_write, "w") as f:
            f.write(best.flags() + "\n")
        print(f"wrote {FLAGS.tune_write}", file=sys.stderr)


def run_scale_table(folder: str, sizes: list[str], clusters: list[str]):
    """Compiles each scale-out preset row missing from `folder` in a process of its own (each compile holds its
    target's compiler state; a failed row is kept as its output and said), then prints the table."""
    import pathlib
    import subprocess

    from resformer_jax.commands import common
    from resformer_jax.compilation import scale_table
    from resformer_jax.presets import CLUSTERS, SCALE_MODELS

    for name, given, known in (("scale_sizes", sizes, SCALE_MODELS), ("scale_clusters", clusters, CLUSTERS)):
        unknown = [x for x in given if x not in known]
        if unknown:
            raise common.ConfigFlagError(f"--{name}: unknown {unknown}; choose from {', '.join(known)}")
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for row in scale_table.rows(sizes, clusters):
        path = out / f"{row.name}.json"
        report = scale_table.read(path)
        if report is None:
            cmd = [sys.executable, "-m", "resformer_jax", *row.command()]
            print(f"+ resformer {' '.join(row.command())}", file=sys.stderr, flush=True)
            part = path.with_suffix(".part")  # renamed when whole: a killed compile never looks like a row
            with open(part, "w") as f, open(out / f"{row.name}.log", "w") as log:
                rc = subprocess.run(cmd, stdout=f, stderr=log).returncode
            part.replace(path)
            report = scale_table.read(path)
            if report is None:
                print(f"  {row.name}: no report (exit {rc}; {out / (row.name + '.log')} says why)", file=sys.stderr)
        reports[row] = report
    print("\n".join(scale_table.markdown(reports)))


def _target_platform(argv) -> str:
    """The platform of --target ('cuda', 'tpu'), read before absl parses flags (the XLA flags must be set before JAX
    starts); '' where it is missing or unknown (main reports that)."""
    from resformer_jax.compilation.targets import TargetError, parse_target

    name = next((a.split("=", 1)[1] for a in argv if a.startswith("--target=")), None)
    if name is None and "--target" in argv[:-1]:
        name = argv[argv.index("--target") + 1]
    try:
        return parse_target(name).platform if name else ""
    except TargetError:
        return ""


def cli_main():
    # The targets' devices are compile-only: JAX must not look for local accelerators (a CUDA plugin without a
    # GPU refuses to start), and the project's CPU XLA defaults must stay off the target's compiler.
    os.environ["JAX_PLATFORMS"] = "cpu"
    from resformer_jax import runtime
    from resformer_jax.commands import common

    runtime.configure_xla_for_target(_target_platform(sys.argv))
    common.check_config_flags(sys.argv)
    common.run_app(main, sys.modules[__name__])
