"""Runs as curves: a run directory's training and validation losses and its config, read for comparison
(compare's relative curves, grouping's verdicts). Reads only; local paths, gs:// and s3:// alike."""

from __future__ import annotations

import json
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from resformer_jax.analysis.grouping import RunCurves, smoothed
from resformer_jax.config import with_defaults
from resformer_jax.errors import UserError
from resformer_jax.metrics import read_jsonl, read_records
from resformer_jax.rundir import SWEEP_MANIFEST, RunDir
from resformer_jax.storage import has_lines, is_remote


class RunsError(UserError):
    """A path given to compare that is not a readable run (or sweep) directory; the message names it."""


def _note(msg: str):
    print(msg, file=sys.stderr, flush=True)


def run_name(run: str) -> str:
    return os.path.basename(os.path.normpath(run.rstrip("/"))) or run


def read_train_loss(run: str) -> dict[int, float]:
    if not RunDir(run).path.exists():
        raise RunsError(f"run directory {run} does not exist; check the path")
    path = RunDir(run).metrics_jsonl
    if has_lines(path):
        curve = read_jsonl(path, "train/loss", warn=_note)
        if not curve:
            raise RunsError(
                f"{run}: metrics.jsonl holds no training loss yet; wait for the run's first logged step or leave it out"
            )
        return curve
    tb = os.fspath(RunDir(run).tensorboard)
    if is_remote(run) or not os.path.isdir(tb):
        raise RunsError(
            f"{run}: neither a non-empty metrics.jsonl nor tb/ found; is it a run directory that has logged a step?"
        )

    ea = EventAccumulator(tb)
    ea.Reload()
    return {e.step: e.value for e in ea.Scalars("train/loss")}


def relative_curves(baseline: dict, runs: dict[str, dict], smooth: int) -> dict[str, tuple[list, list]]:
    """Each run's training loss minus the baseline's at the steps both logged, each smoothed over a trailing
    window of `smooth` training steps."""
    b_s = smoothed(baseline, smooth)
    out = {}
    for name, curve in runs.items():
        steps = sorted(curve)
        sm = smoothed(curve, smooth)
        common = [s for s in steps if s in b_s]
        out[name] = (common, [float(sm[s] - b_s[s]) for s in common])
    return out


def read_run(run: str):
    """(config dict, train curve, eval curves) of a run directory."""
    rd = RunDir(run)
    path = rd.metrics_jsonl
    if not has_lines(path):
        raise RunsError(
            f"{run}: no logged steps (metrics.jsonl missing or empty); is it a run directory that has logged a step?"
        )
    train: dict = {}
    evals: dict = {}
    for rec in read_records(path, warn=_note):
        for k, v in rec.items():
            if k == "train/loss":
                train[rec["step"]] = v
            elif k.startswith("eval/") and k.endswith("loss"):
                evals.setdefault(k, {})[rec["step"]] = v
    if rd.config_json.is_file():
        try:
            config = rd.read_config()
        except ValueError as e:
            raise RunsError(
                f"{rd.config_json} is not valid JSON ({e}); remove it (compare then reads the config from the "
                "run's checkpoints) or leave the run out"
            ) from None
        if not isinstance(config, dict):
            raise RunsError(f"{rd.config_json} does not hold a config object; restore it or leave the run out")
    else:  # runs from before config.json: the checkpoint's copy
        with rd.checkpointer(read_only=True) as ck:  # closed after: compare reads many runs in one process
            steps = ck.all_steps()
            if not steps:
                raise RunsError(f"{run}: neither config.json nor a checkpoint to read its config from")
            config = ck.read_config(steps[-1])
    # as the run ran, with fields added since it was saved at their defaults (a run from before a field existed
    # does not differ from a newer one that leaves it at its default)
    return RunCurves(run_name(run), with_defaults(config), train, evals)


def find_runs(paths: list[str]) -> list[str]:
    """Run directories: each path itself, or the runs a sweep directory (sweep.json, or subdirectories) holds. A
    run in a sweep that has logged nothing yet is left out, saying so."""
    out = []
    for p in paths:
        root = RunDir(p)
        if root.has_metrics():
            out.append(p)
            continue
        manifest = root.path / SWEEP_MANIFEST
        if manifest.is_file():
            try:
                listed = [r["workdir"] for r in json.loads(manifest.read_text())["runs"]]
            except (ValueError, KeyError, TypeError) as e:
                raise RunsError(
                    f"{manifest} is damaged ({type(e).__name__}: {e}); rerun the sweep command to rewrite it"
                ) from None
        elif root.path.is_dir():
            listed = [
                f"{p.rstrip('/')}/{d.name}"
                for d in sorted(root.path.iterdir(), key=lambda d: d.name)
                if RunDir(f"{p.rstrip('/')}/{d.name}").is_run()
            ]
        else:
            raise RunsError(f"{p}: no such run or sweep directory")
        found = [d for d in listed if RunDir(d).has_metrics()]
        if not found:
            raise RunsError(
                f"{p}: not a run directory (no logged steps in metrics.jsonl) and holds no runs that have logged a step"
            )
        skipped = [d for d in listed if d not in found]
        if skipped:
            _note(
                f"note: {p}: left out {len(skipped)} run(s) with no logged steps yet: "
                + ", ".join(run_name(d) for d in skipped)
            )
        out += found
    return out
