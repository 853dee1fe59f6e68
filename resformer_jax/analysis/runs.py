"""Runs as curves: a run directory's training and validation losses and its config, read for comparison
(compare's relative curves, grouping's verdicts). Reads only; local paths, gs:// and s3:// alike."""
from __future__ import annotations

import json
import os

from resformer_jax.rundir import SWEEP_MANIFEST, RunDir
from resformer_jax.storage import has_lines, is_remote, read_lines


def run_name(run: str) -> str:
    return os.path.basename(os.path.normpath(run.rstrip("/"))) or run


def read_train_loss(run: str) -> dict[int, float]:
    from resformer_jax.metrics import read_jsonl
    path = RunDir(run).metrics_jsonl
    if has_lines(path):
        return read_jsonl(path, "train/loss")
    tb = os.fspath(RunDir(run).tensorboard)
    if is_remote(run) or not os.path.isdir(tb):
        raise FileNotFoundError(f"{run}: neither metrics.jsonl nor tb/ found; is it a run directory?")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(tb)
    ea.Reload()
    return {e.step: e.value for e in ea.Scalars("train/loss")}


def relative_curves(baseline: dict, runs: dict[str, dict], smooth: int) -> dict[str, tuple[list, list]]:
    from resformer_jax.analysis.measures import moving_average
    bs = sorted(baseline)
    b_s = dict(zip(bs, moving_average([baseline[s] for s in bs], smooth)))
    out = {}
    for name, curve in runs.items():
        steps = sorted(curve)
        sm = dict(zip(steps, moving_average([curve[s] for s in steps], smooth)))
        common = [s for s in steps if s in b_s]
        out[name] = (common, [float(sm[s] - b_s[s]) for s in common])
    return out


def read_run(run: str):
    """(config dict, train curve, eval curves) of a run directory."""
    from resformer_jax.analysis.grouping import RunCurves
    rd = RunDir(run)
    path = rd.metrics_jsonl
    if not has_lines(path):
        raise FileNotFoundError(f"{run}: no metrics.jsonl; is it a run directory?")
    train, evals = {}, {}
    for line in read_lines(path):
        rec = json.loads(line)
        for k, v in rec.items():
            if k == "train/loss":
                train[rec["step"]] = v
            elif k.startswith("eval/") and k.endswith("loss"):
                evals.setdefault(k, {})[rec["step"]] = v
    if rd.config_json.is_file():
        config = rd.read_config()
    else:  # runs from before config.json: the checkpoint's copy
        ck = rd.checkpointer(read_only=True)
        steps = ck.all_steps()
        if not steps:
            raise FileNotFoundError(f"{run}: neither config.json nor a checkpoint to read its config from")
        config = ck.read_config(steps[-1])
    return RunCurves(run_name(run), config, train, evals)


def find_runs(paths: list[str]) -> list[str]:
    """Run directories: each path itself, or the runs a sweep directory (sweep.json, or subdirectories) holds."""
    out = []
    for p in paths:
        root = RunDir(p)
        if root.has_metrics():
            out.append(p)
            continue
        manifest = root.path / SWEEP_MANIFEST
        if manifest.is_file():
            out += [r["workdir"] for r in json.loads(manifest.read_text())["runs"] if RunDir(r["workdir"]).has_metrics()]
            continue
        subs = sorted(f"{p.rstrip('/')}/{d.name}" for d in root.path.iterdir()) if root.path.is_dir() else []
        found = [d for d in subs if RunDir(d).has_metrics()]
        if not found:
            raise FileNotFoundError(f"{p}: not a run directory (no metrics.jsonl) and holds no runs")
        out += found
    return out
