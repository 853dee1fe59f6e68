"""A grid of runs from one command: variants x seeds (x any config field).

  resformer sweep --config=configs/resformer_82m.py --workdir=runs/sweep82m \\
      --set model.value_residual=none,resformer,svformer --set train.seed=0,1,2 [--config.x=v ...]
  ... --slurm           writes runs/sweep82m/sweep.sbatch (a SLURM array job, launch/slurm_gpu.sbatch's conventions)
  ... --tpu_pod=NAME,ZONE,ACCELERATOR   writes runs/sweep82m/sweep_tpu.sh (launch/tpu_pod.sh per run)

One run directory per combination, named by its values (`value_residual-none_seed-0`), and
`sweep.json` (the manifest: the config file, the fixed overrides, the grid, each run's directory and
its values). Without --slurm / --tpu_pod the runs train here one after another, each as its own
`python -m resformer_jax.main` process; rerunning the same command skips finished runs and resumes an
interrupted one from its checkpoint. A sweep directory can only be rerun with the grid it was
created with. Compare the result with
`resformer compare runs/sweep82m --group_by model.value_residual --baseline none`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shlex
import subprocess
import sys

from absl import app, flags
from ml_collections import config_flags

from resformer_jax import storage
from resformer_jax.commands import common as cli
from resformer_jax.errors import UserError
from resformer_jax.rundir import SWEEP_MANIFEST, RunDir

config_flags.DEFINE_config_file("config", None, "Config file of every run (ml_collections get_config()).")
flags.DEFINE_string("workdir", None, "Sweep directory: one run directory per combination, and sweep.json.")
flags.DEFINE_multi_string(
    "set", [], "FIELD=V1,V2,... (repeatable): a field's values to sweep; tuples join items with '+' (3+5+7)."
)
flags.DEFINE_bool("slurm", False, "Write a SLURM array job instead of running.")
flags.DEFINE_string("tpu_pod", None, "NAME,ZONE,ACCELERATOR: write a TPU-pod script instead of running.")
FLAGS = flags.FLAGS


class SweepError(UserError, ValueError):
    """A malformed grid or a sweep directory created with another grid; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    workdir: str
    values: dict  # dotted field -> value

    def overrides(self) -> list[str]:
        return [f"--config.{k}={_flag_value(v)}" for k, v in self.values.items()]


def _flag_value(v) -> str:
    if isinstance(v, (tuple, list)):  # a tuple field, as ml_collections parses it: (a,b) / (a,) / ()
        return "(" + ",".join(map(str, v)) + ("," if len(v) == 1 else "") + ")"
    return str(v)


def _run_value(v) -> str:
    """A value as it appears in a run directory's name (tuples joined with '+', as --set writes them)."""
    return ("+".join(map(str, v)) or "none") if isinstance(v, (tuple, list)) else str(v)


def _get(cfg, dotted: str):
    from resformer_jax.config import MissingField, get_dotted

    try:
        return get_dotted(cfg, dotted)
    except MissingField as e:
        raise SweepError(
            f"--set {dotted}: no such config field ({e.part!r} is not in {sorted(e.fields)}); check the spelling"
        ) from None


def parse_value(text: str, like):
    """A sweep value from text, typed like the field's current value."""
    if isinstance(like, (tuple, list)):  # a tuple field: items joined with '+' ("3+5"); "none" is empty
        items = [] if text.lower() in ("none", "()", "") else text.split("+")
        typed = [type(like[0]) if like else None] * len(items)
        try:
            return tuple(t(x) if t else (int(x) if x.lstrip("-").isdigit() else x) for t, x in zip(typed, items))
        except ValueError:
            raise SweepError(f"value {text!r} does not fit a tuple of {type(like[0]).__name__}") from None
    try:
        if isinstance(like, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if isinstance(like, int):
            return int(text)
        if isinstance(like, float):
            return float(text)
    except ValueError:
        raise SweepError(f"value {text!r} is not a {type(like).__name__}") from None
    return text


def parse_grid(cfg, sets: list[str]) -> dict[str, list]:
    grid = {}
    for item in sets:
        if "=" not in item:
            raise SweepError(f"--set {item!r}: expected FIELD=V1,V2,... (e.g. --set train.seed=0,1,2)")
        field, values = item.split("=", 1)
        field = field.strip().removeprefix("config.")
        like = _get(cfg, field)
        if field in grid:
            raise SweepError(f"--set {field} given twice; list all its values in one --set")
        try:
            grid[field] = [parse_value(v.strip(), like) for v in values.split(",") if v.strip()]
        except SweepError as e:
            raise SweepError(f"--set {field}: {e}") from None
        if not grid[field]:
            raise SweepError(f"--set {field}: no values")
        dups = sorted({str(v) for v in grid[field] if grid[field].count(v) > 1})
        if dups:
            raise SweepError(f"--set {field}: {', '.join(dups)} given more than once; list each value once")
    if not grid:
        raise SweepError("no --set FIELD=V1,V2,...: nothing to sweep")
    return grid


def run_name(values: dict) -> str:
    """Readable and filesystem-safe: the last part of each field, its value."""
    lasts = [k.split(".")[-1] for k in values]
    parts = []
    for k, v in values.items():
        key = k.split(".")[-1] if lasts.count(k.split(".")[-1]) == 1 else k.replace(".", "-")
        parts.append(f"{key}-{_run_value(v)}")
    return re.sub(r"[^A-Za-z0-9_.+=-]", "-", "_".join(parts))


def plan_runs(workdir: str, grid: dict) -> list[Run]:
    runs: list[Run] = []
    by_name: dict[str, dict] = {}
    for combo in itertools.product(*grid.values()):
        values = dict(zip(grid, combo))
        name = run_name(values)
        if name in by_name:
            raise SweepError(
                f"the combinations {by_name[name]} and {values} map to the same run directory {name!r}; "
                "use values that differ after replacing characters other than letters, digits and "
                "_.+=- with '-'"
            )
        by_name[name] = values
        runs.append(Run(name, os.path.join(workdir, name), values))
    return runs


def check_runs(cfg, runs: list[Run]) -> None:
    """Every combination's config as its run will validate it, before anything is written or submitted (a value
    the config rejects is found here, not on the cluster)."""
    from resformer_jax.config import ConfigError, set_dotted
    from resformer_jax.resolve import check

    for r in runs:
        c = cfg.copy_and_resolve_references()
        for field, value in r.values.items():
            try:
                set_dotted(c, field, value)
            except (TypeError, ValueError) as e:
                raise SweepError(f"run {r.name}: config.{field}={value!r} does not fit the field ({e})") from None
        try:
            check(c)
        except (ConfigError, TypeError, ValueError) as e:
            raise SweepError(f"run {r.name}: {e}") from None


def check_sweep_dir(workdir: str) -> None:
    """The sweep directory must be a folder (or not exist yet)."""
    path = storage.run_path(workdir)
    if path.exists() and not path.is_dir():
        raise SweepError(f"--workdir={workdir} is a file, not a folder; give a folder for the sweep's run directories")


def write_manifest(workdir: str, config_file: str, fixed: list[str], grid: dict, runs: list[Run]) -> dict:
    manifest = {
        "config": config_file,
        "overrides": fixed,
        "grid": grid,
        "runs": [{"name": r.name, "workdir": r.workdir, "values": r.values} for r in runs],
    }
    path = storage.run_path(workdir) / SWEEP_MANIFEST
    if path.is_file():
        old = json.loads(path.read_text())
        for key in ("config", "overrides", "grid"):
            if json.loads(json.dumps(old.get(key))) != json.loads(json.dumps(manifest[key])):
                raise SweepError(
                    f"{workdir} holds a sweep with another {key} ({old.get(key)!r}, now "
                    f"{manifest[key]!r}); rerun with the same flags to resume it, or use a new --workdir"
                )
    path.parent.mkdir(parents=True, exist_ok=True)
    storage.write_json(path, manifest, indent=1)
    return manifest


def finished_step(run_dir: str) -> int:
    """The newest finished checkpoint's step, or -1."""
    return max(RunDir(run_dir).finished_steps(), default=-1)


def command(config_file: str, fixed: list[str], run: Run) -> list[str]:
    main = [sys.executable, "-m", "resformer_jax.main", f"--config={config_file}", f"--workdir={run.workdir}"]
    return [*main, *fixed, *run.overrides()]


def run_locally(config_file: str, fixed: list[str], runs: list[Run], steps_of) -> int:
    for i, r in enumerate(runs):
        steps = steps_of(r)
        done = finished_step(r.workdir)
        if done >= steps:
            print(f"[{i + 1}/{len(runs)}] {r.name}: finished (step {done}), skipped", flush=True)
            continue
        how = f"resuming from step {done}" if done >= 0 else "starting"
        print(f"[{i + 1}/{len(runs)}] {r.name}: {how}", flush=True)
        rc = subprocess.call(command(config_file, fixed, r))
        if rc != 0:
            print(
                f"error: run {r.name} exited with {rc}; fix the cause and rerun the same sweep command "
                "(finished runs are skipped, this one resumes)",
                file=sys.stderr,
            )
            return rc
        if finished_step(r.workdir) < steps:  # stopped early (SIGTERM, stop_at): do not start the next run
            print(
                f"sweep stopped at {r.name} (step {finished_step(r.workdir)} of {steps}); rerun the same "
                "command to resume",
                flush=True,
            )
            return 0
    print(f"sweep done: {len(runs)} runs", flush=True)
    return 0


def slurm_script(config_file: str, fixed: list[str], runs: list[Run], repo: str) -> str:
    """A SLURM array job whose every task is launch/slurm_gpu.sbatch on one run: the launcher's own resources
    (its #SBATCH lines), environment, srun line and failure report, so the two never drift apart."""
    launcher = os.path.join(repo, "launch", "slurm_gpu.sbatch")
    with open(launcher) as f:
        own = ("#SBATCH --job-name", "#SBATCH --output")
        resources = [ln for ln in f.read().splitlines() if ln.startswith("#SBATCH") and not ln.startswith(own)]
    lines = [f"  {shlex.quote(' '.join(shlex.quote(x) for x in [r.workdir, *fixed, *r.overrides()]))}" for r in runs]
    nl = "\n"
    return f"""#!/usr/bin/env bash
# A sweep as a SLURM array job: each array task runs launch/slurm_gpu.sbatch on one run (its resources below are
# that file's). Resubmitting resumes unfinished runs; finished ones stop at once.
#   sbatch [--nodes=N] {{this file}}
#SBATCH --job-name=resformer-sweep
#SBATCH --array=0-{len(runs) - 1}
{nl.join(resources)}
#SBATCH --output=slurm-%A_%a.out
set -euo pipefail
cd {shlex.quote(repo)}
RUNS=(
{nl.join(lines)}
)
eval "ARGS=(${{RUNS[$SLURM_ARRAY_TASK_ID]}})"
exec bash launch/slurm_gpu.sbatch {shlex.quote(config_file)} "${{ARGS[@]}}"
"""


def tpu_script(config_file: str, fixed: list[str], runs: list[Run], pod: str, repo: str) -> str:
    name, zone, accel = pod.split(",")
    body = "\n".join(
        "launch/tpu_pod.sh "
        + " ".join(shlex.quote(x) for x in [name, zone, accel, config_file, r.workdir, *fixed, *r.overrides()])
        for r in runs
    )
    return f"""#!/usr/bin/env bash
# A sweep on one TPU pod slice: the runs one after another through launch/tpu_pod.sh (every worker runs
# each). Rerunning resumes the unfinished run; finished ones stop at once. Use a gs:// sweep directory.
set -euo pipefail
cd {shlex.quote(repo)}
{body}
"""


def main(argv):
    cli.start()
    if FLAGS.config is None or not FLAGS.workdir:
        raise app.UsageError("--config and --workdir are required")
    config_file = FLAGS["config"].config_filename
    fixed = [a for a in sys.argv[1:] if a.startswith("--config.")]
    try:
        grid = parse_grid(FLAGS.config, FLAGS.set)
        if FLAGS.tpu_pod and len(FLAGS.tpu_pod.split(",")) != 3:
            raise SweepError(f"--tpu_pod={FLAGS.tpu_pod!r}: expected NAME,ZONE,ACCELERATOR (e.g. rf,us-east5-a,v5p-64)")
        check_sweep_dir(FLAGS.workdir)
        runs = plan_runs(FLAGS.workdir, grid)
        check_runs(FLAGS.config, runs)
        write_manifest(FLAGS.workdir, config_file, fixed, grid, runs)
    except (UserError, OSError) as e:
        sys.exit(cli.report_user_error(e))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
    if FLAGS.slurm or FLAGS.tpu_pod:
        script, text = (
            ("sweep.sbatch", slurm_script(config_file, fixed, runs, repo))
            if FLAGS.slurm
            else ("sweep_tpu.sh", tpu_script(config_file, fixed, runs, FLAGS.tpu_pod, repo))
        )
        # A script runs from a local disk: beside a cloud sweep directory's name, in the current folder.
        path = os.path.join(FLAGS.workdir if not storage.is_remote(FLAGS.workdir) else ".", script)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
        print(f"wrote {path} ({len(runs)} runs); " + (f"submit with: sbatch {path}" if FLAGS.slurm else f"run: {path}"))
        return

    def steps_of(run: Run) -> int:
        return int(run.values.get("train.steps", FLAGS.config.train.steps))

    sys.exit(run_locally(config_file, fixed, runs, steps_of))


def cli_main():
    cli.check_config_flags(sys.argv)
    cli.run_app(main, sys.modules[__name__])
