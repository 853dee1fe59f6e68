"""Comparisons that account for seed noise: runs grouped by a config field, seeds pooled.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from resformer_jax.config import get_dotted


@dataclasses.dataclass
class RunCurves:
    name: str
    config: dict
    train: dict[int, float]  # step -> training loss
    evals: dict[str, dict[int, float]]  # "eval/<domain>/loss" or "eval/loss" -> step -> loss


def get_field(config: dict, dotted: str):
    """A config field's value; FIELD+FIELD (a group defined by several fields, e.g.
    model.value_residual+model.resformer_lambdas) joins their values with '/' (resformer/convex)."""
    if "+" in dotted:
        return "/".join(str(get_field(config, part)) for part in dotted.split("+"))
    return get_dotted(config, dotted)


def smoothed(curve: dict[int, float], window_steps: int) -> dict[int, float]:
    """Trailing moving average over a window of `window_steps` training steps, whatever the logging interval: the
    value at step s averages the logged points in (s - window_steps, s] (each logged point already averages the
    steps since the previous one, so with log_every=10 a 100-step window holds 10 points, as the paper's 100-step
    smoothing of per-step losses does)."""
    steps = np.array(sorted(curve), np.int64)
    vals = np.array([curve[s] for s in steps], np.float64)
    if window_steps <= 1 or len(steps) == 0:
        return dict(zip(steps.tolist(), vals.tolist()))
    c = np.concatenate([[0.0], np.cumsum(vals)])
    lo = np.searchsorted(steps, steps - window_steps, side="right")
    idx = np.arange(1, len(steps) + 1)
    return dict(zip(steps.tolist(), ((c[idx] - c[lo]) / (idx - lo)).tolist()))


def mean_over_last_steps(curve: dict[int, float], steps: int) -> float:
    """The mean training loss over the last `steps` training steps (paper Fig. 5 middle: the last 50): the logged
    points in (last - steps, last], each the mean of the steps since the one before."""
    s = np.array(sorted(curve), np.int64)
    keep = s > s[-1] - steps
    return float(np.mean([curve[int(x)] for x in s[keep]]))


# Config fields that do not change what a run computes (bookkeeping, layout, speed): runs may differ in them and
# still be compared. Any other difference besides the grouping field and the seed is a different experiment.
NEUTRAL_FIELDS = (
    "checkpoint.",
    "mesh.",
    "distributed.",
    "data.num_threads",
    "data.prefetch",
    "data.tokenizer_hash",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.stop_at",
    "train.microbatch",
    "train.loss_chunk_len",
    "model.attention_impl",
    "model.remat",
    "model.scan_layers",
)


def flat_fields(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_fields(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = repr(v)
    return out


def differing_fields(runs: list[RunCurves], exclude: tuple[str, ...]) -> list[str]:
    """Config fields (dotted) whose values differ across `runs`, besides `exclude` and the neutral fields."""
    flats = [flat_fields(r.config) for r in runs]
    keys = set().union(*flats) if flats else set()
    return sorted(
        k for k in keys if not k.startswith(NEUTRAL_FIELDS) and k not in exclude and len({f.get(k) for f in flats}) > 1
    )


def band(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    """(low, high, kind) over axis 0 (seeds): min-max below 3 seeds, mean +- standard error from 3."""
    if len(values) >= 3:
        m, se = values.mean(axis=0), values.std(axis=0, ddof=1) / math.sqrt(len(values))
        return m - se, m + se, "standard error"
    return values.min(axis=0), values.max(axis=0), "min-max"


def pooled_std(groups: list[np.ndarray]) -> float:
    """Pooled standard deviation of several groups of samples (nan if no group has 2)."""
    num = sum(((g - g.mean()) ** 2).sum() for g in groups if len(g) >= 2)
    dof = sum(len(g) - 1 for g in groups if len(g) >= 2)
    return float(math.sqrt(num / dof)) if dof > 0 else float("nan")


@dataclasses.dataclass
class GroupComparison:
    group: str
    seeds: list
    paired: bool
    steps: list[int]
    relative: list[float]  # mean relative curve
    low: list[float]
    high: list[float]
    band_kind: str
    final_relative: float
    final_spread: float  # max - min of the final relative value over seeds (paired) or of the group's finals
    seed_noise: float  # pooled seed std of the final losses of this group and the baseline
    verdict: str
    final_eval_relative: dict[str, float]


def _stack(curves: list[dict[int, float]], steps: list[int]) -> np.ndarray:
    return np.array([[c[s] for s in steps] for c in curves], np.float64)


def compare_groups(
    runs: list[RunCurves], group_by: str, baseline: str, smooth: int = 100, seed_field: str = "train.seed"
) -> dict[str, GroupComparison]:
    groups: dict[str, list[RunCurves]] = {}
    for r in runs:
        groups.setdefault(str(get_field(r.config, group_by)), []).append(r)
    if baseline not in groups:
        raise ValueError(f"no run has {group_by}={baseline!r}; groups found: {sorted(groups)}")
    seed = lambda r: get_field(r.config, seed_field)
    base = {seed(r): smoothed(r.train, smooth) for r in groups[baseline]}
    out = {}
    for name, members in sorted(groups.items()):
        cur = {seed(r): smoothed(r.train, smooth) for r in members}
        shared = sorted(set(cur) & set(base))
        paired = bool(shared)
        used_cur = [cur[s] for s in (shared if paired else sorted(cur))]
        used_base = [base[s] for s in (shared if paired else sorted(base))]
        steps = sorted(set.intersection(*(set(c) for c in used_cur + used_base)))
        if not steps:
            continue
        C, Bm = _stack(used_cur, steps), _stack(used_base, steps)
        if paired:
            rel = C - Bm  # per seed
            mean = rel.mean(axis=0)
            lo, hi, kind = band(rel)
            finals = rel[:, -1]
        else:
            mean = C.mean(axis=0) - Bm.mean(axis=0)
            lo_c, hi_c, kind = band(C)
            lo, hi = lo_c - Bm.mean(axis=0), hi_c - Bm.mean(axis=0)
            finals = C[:, -1] - Bm[:, -1].mean()
        noise = pooled_std([C[:, -1], Bm[:, -1]]) if name != baseline else pooled_std([C[:, -1]])
        gap = float(mean[-1])
        if name == baseline:
            verdict = "baseline"
        elif math.isnan(noise):
            verdict = "no verdict: needs 2 or more seeds in a group"
        else:
            verdict = "gap larger than seed noise" if abs(gap) > noise else "within seed noise"
        ev = {}
        for key in sorted({k for r in members for k in r.evals}):
            g_final = [r.evals[key][max(r.evals[key])] for r in members if r.evals.get(key)]
            b_final = [r.evals[key][max(r.evals[key])] for r in groups[baseline] if r.evals.get(key)]
            if g_final and b_final:
                ev[key] = float(np.mean(g_final) - np.mean(b_final))
        out[name] = GroupComparison(
            name,
            sorted(cur),
            paired,
            steps,
            mean.tolist(),
            lo.tolist(),
            hi.tolist(),
            kind,
            gap,
            float(finals.max() - finals.min()),
            noise,
            verdict,
            ev,
        )
    return out


def relative_eval_curves(runs: list[RunCurves], group_by: str, baseline: str, key: str) -> dict[str, tuple]:
    """Per group: (steps, mean relative eval loss, low, high) for one eval key, over the groups' seeds."""
    groups: dict[str, list[RunCurves]] = {}
    for r in runs:
        groups.setdefault(str(get_field(r.config, group_by)), []).append(r)
    base = [r.evals.get(key, {}) for r in groups.get(baseline, [])]
    out = {}
    for name, members in groups.items():
        cur = [r.evals.get(key, {}) for r in members]
        sets = [set(c) for c in cur + base if c]
        if not sets or not all(cur) or not all(base):
            continue
        steps = sorted(set.intersection(*sets))
        if not steps:
            continue
        C, Bm = _stack(cur, steps), _stack(base, steps)
        lo, hi, _ = band(C)
        out[name] = (steps, (C.mean(0) - Bm.mean(0)).tolist(), (lo - Bm.mean(0)).tolist(), (hi - Bm.mean(0)).tolist())
    return out


# ----------------------------------------------------------------------------- scaling


def fit_power_law(x, y) -> tuple[float, float]:
    """(a, b) of y = a * x^(-b), least squares in log-log space."""
    lx, ly = np.log(np.asarray(x, np.float64)), np.log(np.asarray(y, np.float64))
    slope, intercept = np.polyfit(lx, ly, 1)
    return float(math.exp(intercept)), float(-slope)


def needed_for_same_loss(fit_variant: tuple[float, float], fit_base: tuple[float, float], x_base: float) -> float:
    """The x (parameters or tokens) the variant needs to reach the baseline's fitted loss at x_base."""
    a_v, b_v = fit_variant
    a_b, b_b = fit_base
    target = a_b * x_base ** (-b_b)
    return (a_v / target) ** (1.0 / b_v)


def saving(fit_variant, fit_base, xs_base) -> float:
    """Mean fraction of x saved (1 - x_variant / x_base) for the same loss, over the baseline's xs."""
    return float(np.mean([1.0 - needed_for_same_loss(fit_variant, fit_base, x) / x for x in xs_base]))


# ----------------------------------------------------------------------------- critical points (Fig. 11 right)


def critical_point(steps, relative, last: int = 1000) -> tuple[float | None, bool]:
    """The step at which the relative training loss (variant - baseline) turns non-negative for good, i.e. the
    variant is overtaken (paper Sec. 4.6), interpolated between the logged steps around it; (step, False) when it
    happens within the run. When it does not, the
    paper predicts it by a linear regression over the last `last` training steps: (predicted step, True), or
    (None, True) when that line does not rise towards zero."""
    steps, rel = np.asarray(steps, np.float64), np.asarray(relative, np.float64)
    below = np.nonzero(rel < 0)[0]
    if len(below) and below[-1] < len(rel) - 1:
        # between the last logged step below zero and the next one, where the line through them meets zero (a
        # coarse logging interval does not move the step by a whole interval)
        i = below[-1]
        s0, s1, r0, r1 = steps[i], steps[i + 1], rel[i], rel[i + 1]
        return float(s0 + (s1 - s0) * (-r0) / (r1 - r0)) if r1 != r0 else float(s1), False
    if not len(below):
        return float(steps[0]), False
    tail = steps > steps[-1] - last  # the last `last` training steps (whatever the logging interval)
    if tail.sum() < 2:
        tail[-2:] = True
    slope, intercept = np.polyfit(steps[tail], rel[tail], 1)
    span = steps[tail][-1] - steps[tail][0]
    if slope * span <= 1e-9 * max(1.0, float(np.abs(rel[tail]).max())):  # flat (to rounding) or falling
        return None, True
    return float(-intercept / slope), True


def fit_exponential(x, y) -> tuple[float, float]:
    """(a, b) of y = a * exp(b x), least squares on log y (the paper's trend of critical point against length)."""
    slope, intercept = np.polyfit(np.asarray(x, np.float64), np.log(np.asarray(y, np.float64)), 1)
    return float(math.exp(intercept)), float(slope)
