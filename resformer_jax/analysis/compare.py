"""Comparing runs: pairwise against a baseline run, or grouped by a config field with seeds pooled (cohorts,
relative curves with seed bands, per-domain gaps, a verdict), critical points and scaling fits, each with its plot,
JSON and TensorBoard scalars. The arithmetic is grouping.py's; `resformer compare` parses flags and calls here."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import numpy as np
from etils import epath

from resformer_jax.analysis import grouping
from resformer_jax.analysis.runs import RunsError, find_runs, read_run, read_train_loss, relative_curves, run_name
from resformer_jax.config import RunConfig, with_defaults
from resformer_jax.metrics import Writer
from resformer_jax.perf import model_flops
from resformer_jax.rundir import RunDir
from resformer_jax.storage import run_path, save_figure
from resformer_jax.train import goodput


@dataclasses.dataclass
class CompareOptions:
    runs: list[str]  # run directories, or sweep directories holding them (grouped)
    baseline: str  # the vanilla run; grouped: the baseline group's value of group_by
    group_by: str | None = None  # a config field, e.g. model.value_residual
    scaling: bool = False
    scaling_loss: str = "train_last50"
    smooth: int = 100  # training steps in the moving-average window
    vs: str | None = None
    last: int = 1000
    out: str | None = None


def clip_smooth(a: CompareOptions, last_step: int) -> None:
    """A window longer than the runs is cut to their length, saying so (the plot's title gives the window used)."""
    if 0 < last_step < a.smooth:
        print(
            f"note: --smooth={a.smooth} is longer than the runs ({last_step} steps logged); smoothing over "
            f"{last_step} steps",
            file=sys.stderr,
        )
        a.smooth = last_step


def cohorts(runs, group_by: str, vs: str | None, split_all: bool = False) -> dict[str, list]:
    """The runs split by `vs` (one comparison per value: Fig. 5 left / Fig. 11 left), after checking that they
    differ in nothing else but the grouping field and the seed: runs of different experiments are never merged.
    split_all (--scaling: a sweep over sizes): one comparison per combination of whatever fields differ."""
    exclude = (group_by, *group_by.split("+"), "train.seed") + ((vs,) if vs else ())
    differ = grouping.differing_fields(runs, exclude)
    if differ and not split_all:
        raise RunsError(
            f"the runs differ in {', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''} besides "
            f"{group_by} and the seed; comparing them as one would merge different experiments. Give "
            f"--vs={differ[0]} (one comparison per value), or compare the runs of each value apart"
        )
    fields = ([vs] if vs else []) + (differ if split_all else [])
    if not fields:
        return {"": runs}
    out: dict = {}
    for r in runs:
        try:
            values = [grouping.get_field(r.config, f) for f in fields]
        except KeyError as e:
            raise RunsError(f"--vs {vs}: no such config field in {r.name} ({e})") from None
        out.setdefault(tuple(values), []).append(r)
    return {
        ", ".join(f"{f}={v}" for f, v in zip(fields, key)): members
        for key, members in sorted(out.items(), key=lambda kv: [_sort_key(str(v)) for v in kv[0]])
    }


def _sort_key(v: str):
    try:
        return (0, float(v), "")
    except ValueError:
        return (1, 0.0, v)


def grouped(a: CompareOptions) -> int:
    assert a.group_by is not None  # grouped runs only with --group_by

    runs = [read_run(r) for r in find_runs(a.runs)]
    clip_smooth(a, max((max(r.train, default=0) for r in runs), default=0))
    res, split = {}, cohorts(runs, a.group_by, a.vs, a.scaling)
    for label, members in split.items():
        try:
            found = grouping.compare_groups(members, a.group_by, a.baseline, a.smooth)
        except KeyError as e:
            raise RunsError(f"--group_by {a.group_by}: no such config field ({e})") from None
        except ValueError as e:
            raise RunsError(f"--group_by {a.group_by}{' at ' + label if label else ''}: {e}") from None
        res.update({(f"{n} [{label}]" if label else n): g for n, g in found.items()})
    out = run_path(a.out) if a.out else run_path(a.runs[0]) / "compare"
    out.mkdir(parents=True, exist_ok=True)
    _plot_relative_train_loss(a, res, out)
    eval_keys = sorted({k for r in runs for k in r.evals})
    eval_curves: dict[str, dict] = {k: {} for k in eval_keys}
    for label, members in split.items():
        for k in eval_keys:
            try:
                curves = grouping.relative_eval_curves(members, a.group_by, a.baseline, k)
            except ValueError:
                continue
            eval_curves[k].update({(f"{n} [{label}]" if label else n): c for n, c in curves.items()})
    if eval_keys:
        _plot_relative_eval(eval_keys, eval_curves, out)
    report = {
        "group_by": a.group_by,
        "baseline": a.baseline,
        "smooth": a.smooth,
        "groups": {n: dataclasses.asdict(g) for n, g in res.items()},
        "relative_eval": {
            k: {n: {"steps": c[0], "relative": c[1], "low": c[2], "high": c[3]} for n, c in v.items()}
            for k, v in eval_curves.items()
        },
    }
    print(
        f"{a.group_by:>24} {'seeds':>5} {'paired':>6} {'final rel. train loss':>22} {'seed spread':>11} "
        f"{'seed noise':>10}  verdict"
    )
    for n, g in res.items():
        print(
            f"{n:>24} {len(g.seeds):>5} {g.paired!s:>6} {g.final_relative:>+22.4f} {g.final_spread:>11.4f} "
            + (f"{g.seed_noise:>10.4f}" if np.isfinite(g.seed_noise) else f"{'n/a 1 seed':>10}")
            + f"  {g.verdict}"
        )
        for key, v in g.final_eval_relative.items():
            print(f"{'':>24} {key}: {v:+.4f}")
    if a.scaling:
        report["scaling"] = scaling(runs, a.group_by, a.baseline, out, a.scaling_loss)
    if a.vs:
        report["critical_points"] = critical_points(runs, a.group_by, a.baseline, a.vs, a.smooth, a.last, out)
    (out / "grouped_comparison.json").write_text(json.dumps(report, indent=1, default=float))
    print(
        f"wrote {out}/relative_train_loss.png, relative_validation_loss.png, grouped_comparison.json and "
        f"TensorBoard logs under {out}/tb"
    )
    return 0


def _plot_relative_train_loss(a: CompareOptions, res: dict, out: epath.Path) -> None:
    """relative_train_loss.png (each group's mean over seeds, its band) and the same curves in TensorBoard."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, g in res.items():
        (line,) = ax.plot(g.steps, g.relative, label=f"{a.group_by}={name} ({len(g.seeds)} seeds)")
        ax.fill_between(g.steps, g.low, g.high, color=line.get_color(), alpha=0.2)
        w = Writer(out / "tb" / name)
        for i, st in enumerate(g.steps):
            w.scalars(
                st,
                {
                    "relative/train_loss": g.relative[i],
                    "relative/train_loss_low": g.low[i],
                    "relative/train_loss_high": g.high[i],
                },
            )
        w.close()
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss - ({a.group_by}={a.baseline})")
    ax.set_title(f"relative training loss\n(smoothed over {a.smooth} steps; band over seeds)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out / "relative_train_loss.png")
    plt.close(fig)


def _plot_relative_eval(eval_keys: list[str], eval_curves: dict[str, dict], out: epath.Path) -> None:
    """relative_validation_loss.png, a panel a validation set, and the same curves in TensorBoard."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(eval_keys), figsize=(4.5 * len(eval_keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], eval_keys):
        for name, (steps, mean, lo, hi) in eval_curves[key].items():
            (line,) = ax.plot(steps, mean, marker="o", label=name)
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
            w = Writer(out / "tb" / name)
            for i, st in enumerate(steps):
                w.scalars(st, {f"relative/{key}": mean[i]})
            w.close()
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_title(f"relative {key}")
        ax.legend()
    fig.tight_layout()
    save_figure(fig, out / "relative_validation_loss.png")
    plt.close(fig)


def critical_points(runs, group_by: str, baseline: str, vs: str, smooth: int, last: int, out: epath.Path) -> dict:
    """Fig. 11 right: for each value of `vs` (e.g. data.seq_len), each group's relative training loss and the
    step where the baseline overtakes it (predicted by a line over the last points where it has not yet),
    then an exponential fit of that step against `vs`."""
    import matplotlib.pyplot as plt

    by_value: dict = {}
    for r in runs:
        by_value.setdefault(grouping.get_field(r.config, vs), []).append(r)
    res: dict[str, dict] = {}
    for value, members in sorted(by_value.items()):
        try:
            groups = grouping.compare_groups(members, group_by, baseline, smooth)
        except ValueError:
            continue  # no baseline run at this value
        for name, g in groups.items():
            if name == baseline:
                continue
            step, predicted = grouping.critical_point(g.steps, g.relative, last)
            res.setdefault(name, {})[str(value)] = {
                "critical_step": step,
                "predicted": predicted,
                "final_relative": g.final_relative,
            }
    fig, ax = plt.subplots(figsize=(5, 3.5))
    numeric = all(_is_number(v) for per in res.values() for v in per)
    for name, per in res.items():
        # Fig. 11's fit needs a numeric field (seq_len); a categorical one (train.optimizer) is a bar per value
        pts = [(float(v) if numeric else v, d["critical_step"]) for v, d in per.items() if d["critical_step"]]
        if numeric and len(pts) >= 2:
            a_, b_ = grouping.fit_exponential(*zip(*pts))
            per["fit"] = {"a": a_, "b": b_, "form": f"critical_step = a * exp(b * {vs})"}
            print(f"{name}: critical step = {a_:.4g} * exp({b_:.4g} * {vs})")
        for v, d in per.items():
            if v != "fit":
                print(
                    f"{name} at {vs}={v}: critical step {d['critical_step']}"
                    + (" (predicted by a line over the last points)" if d["predicted"] else "")
                )
        if pts:
            ax.plot(*zip(*sorted(pts)), "o-", label=name)
    ax.set_xlabel(vs)
    ax.set_ylabel(f"step where {baseline} overtakes")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out / "critical_points.png")
    plt.close(fig)
    return res


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def scaling(runs, group_by: str, baseline: str, out: epath.Path, measure: str = "train_last50") -> dict:
    """Loss against parameters (Fig. 5 middle: by default the paper's measure, the mean training loss over the last
    50 training steps; or the final validation loss) and validation loss against tokens, a power law per group,
    and the savings readout."""
    import matplotlib.pyplot as plt

    by_group: dict[str, dict[int, list]] = {}

    def final_loss(r) -> float:
        if measure == "validation":
            return r.evals["eval/loss"][max(r.evals["eval/loss"])]
        return grouping.mean_over_last_steps(r.train, 50)

    for r in runs:
        key = "eval/loss"
        if not r.evals.get(key) or (measure != "validation" and not r.train):
            continue
        m = RunConfig.of(with_defaults(r.config), strict=False).model  # a saved run's config, typed
        n = model_flops(m, r.config["data"]["seq_len"]).params_non_embedding
        by_group.setdefault(str(grouping.get_field(r.config, group_by)), {}).setdefault(n, []).append(r)
    res: dict[str, dict] = {}
    fig, (ax_n, ax_d) = plt.subplots(1, 2, figsize=(10, 4))
    fits_n, fits_d, xs = {}, {}, {}
    for g, sizes in sorted(by_group.items()):
        ns = sorted(sizes)
        losses = [float(np.mean([final_loss(r) for r in sizes[n]])) for n in ns]
        entry: dict[str, Any] = {"params_non_embedding": ns, "loss_measure": measure, "final_loss": losses}
        if len(ns) >= 2:
            fits_n[g] = grouping.fit_power_law(ns, losses)
            entry["fit_params"] = {"a": fits_n[g][0], "b": fits_n[g][1], "form": "loss = a * N^-b"}
        (line,) = ax_n.loglog(ns, losses, "o", label=g)
        if g in fits_n:
            grid = np.geomspace(min(ns), max(ns), 50)
            ax_n.loglog(grid, fits_n[g][0] * grid ** -fits_n[g][1], color=line.get_color())
        # tokens: the largest model's validation curve (seeds averaged), tokens = step * batch * seq_len
        big = sizes[ns[-1]]
        steps = sorted(set.intersection(*(set(r.evals["eval/loss"]) for r in big)) - {0})
        tok = [s * big[0].config["train"]["global_batch"] * big[0].config["data"]["seq_len"] for s in steps]
        curve = [float(np.mean([r.evals["eval/loss"][s] for r in big])) for s in steps]
        entry.update(tokens=tok, validation_loss_by_tokens=curve)
        if len(tok) >= 2:
            fits_d[g] = grouping.fit_power_law(tok, curve)
            entry["fit_tokens"] = {"a": fits_d[g][0], "b": fits_d[g][1], "form": "loss = a * D^-b"}
            ax_d.loglog(tok, curve, "o-", label=g)
        xs[g] = (ns, tok)
        res[g] = entry
    for g in res:
        if g != baseline and g in fits_n and baseline in fits_n:
            res[g]["fewer_params_for_same_loss"] = grouping.saving(fits_n[g], fits_n[baseline], xs[baseline][0])
        if g != baseline and g in fits_d and baseline in fits_d:
            res[g]["fewer_tokens_for_same_loss"] = grouping.saving(fits_d[g], fits_d[baseline], xs[baseline][1])
        if "fewer_params_for_same_loss" in res[g]:
            print(
                f"{g} needs {100 * res[g]['fewer_params_for_same_loss']:.2f}% fewer parameters"
                + (
                    f" and {100 * res[g]['fewer_tokens_for_same_loss']:.2f}% fewer tokens"
                    if "fewer_tokens_for_same_loss" in res[g]
                    else ""
                )
                + f" than {baseline} for the same loss (fitted power laws; parameters on "
                + (
                    "the final validation loss"
                    if measure == "validation"
                    else "the mean training loss of the last 50 steps, as Fig. 5 middle"
                )
                + ", tokens on validation loss)"
            )
    ax_n.set_xlabel("non-embedding parameters")
    ax_n.set_ylabel("final validation loss" if measure == "validation" else "training loss, mean of the last 50 steps")
    ax_d.set_xlabel("training tokens (largest model)")
    for ax in (ax_n, ax_d):
        ax.legend()
    fig.tight_layout()
    save_figure(fig, out / "scaling.png")
    plt.close(fig)
    return res


def differs_from(baseline: str, run: str) -> dict[str, tuple[str, str]]:
    """{field: (baseline's value, run's)} for the config fields in which `run` differs from `baseline` besides
    the value-residual fields, the seed and the fields that do not change what a run computes (grouping's)."""
    try:
        a, b = (grouping.flat_fields(with_defaults(RunDir(r).read_config())) for r in (baseline, run))
    except (OSError, ValueError):
        return {}
    skip = ("model.value_residual", "model.resformer_", "train.seed", "resolved.")
    return {
        k: (a.get(k, "-"), b.get(k, "-"))
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and not k.startswith(grouping.NEUTRAL_FIELDS) and not k.startswith(skip)
    }


def pairwise(a: CompareOptions) -> int:
    """Each run's smoothed training loss minus the baseline's (Fig. 5 / Fig. 1 left): PNG, JSON, TensorBoard."""
    base = read_train_loss(a.baseline)
    runs = {run_name(r): read_train_loss(r) for r in a.runs}
    for r in a.runs:
        differ = differs_from(a.baseline, r)
        if differ:
            print(
                f"note: {run_name(r)} differs from the baseline {run_name(a.baseline)} in more than the value "
                "residual: "
                + ", ".join(f"{k} {v!s} (baseline {b!s})" for k, (b, v) in differ.items())
                + "; its relative loss mixes these effects"
            )
    clip_smooth(a, max([max(base, default=0)] + [max(c, default=0) for c in runs.values()]))
    curves = relative_curves(base, runs, a.smooth)
    out = run_path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (steps, rel) in curves.items():
        ax.plot(steps, rel, label=name)
        w = Writer(out / "tb" / name)
        for s, v in zip(steps, rel):
            w.scalars(s, {"relative/train_loss": v})
        w.close()
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss - {run_name(a.baseline)}")
    ax.set_title(f"relative training loss (smoothed over {a.smooth} steps)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out / "relative_train_loss.png")
    (out / "relative_train_loss.json").write_text(
        json.dumps({n: {"steps": s, "relative": r} for n, (s, r) in curves.items()})
    )
    for name, (steps, rel) in curves.items():
        print(
            f"{name}: final relative train loss {rel[-1]:+.4f} at step {steps[-1]}"
            if rel
            else f"{name}: no common steps"
        )
    print(f"wrote {a.out}/relative_train_loss.png and TensorBoard logs under {a.out}/tb")
    return 0


def goodput_table(paths: list[str]) -> int:
    """Where each run's wall time went (RUN/goodput.json, added up over its invocations): one row a run."""
    runs = find_runs(paths)
    cols = ("startup", "compile", "restore", "data_wait", "eval", "checkpoint", "stalled")
    w = max([28, *(len(run_name(r)) for r in runs)])
    print(
        f"{'run':<{w}} {'goodput':>8} {'wall s':>9} {'steps s':>9} {'recomp s':>9} "
        + " ".join(f"{c:>10}" for c in cols)
    )
    for r in runs:
        invocations = goodput.read(RunDir(r).goodput_json)
        if not invocations:
            print(f"{run_name(r):<{w}} (no goodput.json: trained before the ledger existed)")
            continue
        t = goodput.totals(invocations)
        print(
            f"{run_name(r):<{w}} {100 * t['goodput']:7.1f}% {t['wall_s']:9.0f} {t['seconds']['steps']:9.0f} "
            f"{t['recomputed_s']:9.0f} "
            + " ".join(f"{t['seconds'][c]:10.0f}" for c in cols)
            + f"  ({t['invocations']} invocation(s)"
            + (f", {t['unknown']} ended without a word)" if t["unknown"] else ")")
        )
    return 0
