"""Relative training loss of runs against a baseline (the paper's Fig. 5 / Fig. 1 left).

  python -m resformer_jax.compare --baseline RUN_VANILLA RUN_A RUN_B ... [--smooth 100] --out DIR

Each run's training loss is smoothed with a trailing moving window, the
baseline's is subtracted at the steps both logged, and the result is plotted
to DIR/relative_train_loss.png and written as TensorBoard scalars
`relative/train_loss` under DIR/tb/<run name> (so `tensorboard --logdir DIR/tb`
shows the same curves) and as DIR/relative_train_loss.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys



def read_train_loss(run: str) -> dict[int, float]:
    from resformer_jax.metrics import read_jsonl
    path = os.path.join(run, "metrics.jsonl")
    if os.path.isfile(path):
        return read_jsonl(path, "train/loss")
    tb = os.path.join(run, "tb")
    if not os.path.isdir(tb):
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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m resformer_jax.compare")
    p.add_argument("--baseline", required=True, help="the vanilla run")
    p.add_argument("runs", nargs="+", help="runs to compare")
    p.add_argument("--smooth", type=int, default=100, help="moving-average window in logged points")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        base = read_train_loss(a.baseline)
        runs = {os.path.basename(os.path.normpath(r)) or r: read_train_loss(r) for r in a.runs}
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    curves = relative_curves(base, runs, a.smooth)
    os.makedirs(a.out, exist_ok=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from resformer_jax.metrics import Writer
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (steps, rel) in curves.items():
        ax.plot(steps, rel, label=name)
        w = Writer(os.path.join(a.out, "tb", name))
        for s, v in zip(steps, rel):
            w.scalars(s, {"relative/train_loss": v})
        w.close()
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss - {os.path.basename(os.path.normpath(a.baseline))}")
    ax.set_title(f"relative training loss (smoothed over {a.smooth})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "relative_train_loss.png"), dpi=100)
    with open(os.path.join(a.out, "relative_train_loss.json"), "w") as f:
        json.dump({n: {"steps": s, "relative": r} for n, (s, r) in curves.items()}, f)
    for name, (steps, rel) in curves.items():
        print(f"{name}: final relative train loss {rel[-1]:+.4f} at step {steps[-1]}" if rel else f"{name}: no common steps")
    print(f"wrote {a.out}/relative_train_loss.png and TensorBoard logs under {a.out}/tb")
    return 0


if __name__ == "__main__":
    sys.exit(main())
