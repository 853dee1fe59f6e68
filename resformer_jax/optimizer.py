"""The optimizer and its schedule, from optax: AdamW with global-norm clipping and warmup-cosine (the paper,
Sec. 4.1.1), or Muon on the hidden weight matrices with AdamW on the rest; warmup-cosine, warmup-stable-decay or
constant learning rates."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

# The projections Muon orthogonalises, by parameter name: (how many leading non-batch axes are the input).
# query/key/value [E, heads, D]: the input is E; out [H, D, E]: the input is H x D; the MLP's [in, out].
_MATRIX_INPUT_AXES = (
    ("query", 1),
    ("key", 1),
    ("value", 1),
    ("out", 2),
    ("gate", 1),
    ("up", 1),
    ("down", 1),
)


def _names(path) -> list[str]:
    return [k.key for k in path if hasattr(k, "key")]  # skips a logical-partitioning box's `.value`


def decay_start(t) -> int:
    """The step the WSD decay starts at: `decay_start_step` where set (a cooldown forked from a checkpoint), else
    after the warmup and stable fractions of `steps`."""
    if t.decay_start_step > 0:
        return int(t.decay_start_step)
    warmup, stable, _ = t.wsd_fractions
    return round((warmup + stable) * t.steps)


def lr_schedule(t):
    """The learning rate at each step (t: the config's `train` section).

    cosine: linear warmup from init_lr to peak_lr over warmup_steps, then cosine to final_lr_ratio * peak at
    `steps` (the paper). wsd: warmup over wsd_fractions[0] of the steps, peak_lr until the decay starts
    (`decay_start`), then down to final_lr_ratio * peak at `steps` in the wsd_decay_shape (linear, cosine, or
    1-sqrt: 1 - sqrt of the decay's progress). constant: warmup, then peak_lr."""
    schedule = t.schedule
    final = t.peak_lr * t.final_lr_ratio
    if schedule == "cosine":
        ramp = dict(init_value=t.init_lr, peak_value=t.peak_lr, warmup_steps=t.warmup_steps)
        return optax.warmup_cosine_decay_schedule(**ramp, decay_steps=t.steps, end_value=final)
    if schedule == "constant":
        return optax.join_schedules(
            [optax.linear_schedule(t.init_lr, t.peak_lr, t.warmup_steps), optax.constant_schedule(t.peak_lr)],
            [t.warmup_steps],
        )
    warmup = round(t.wsd_fractions[0] * t.steps)
    start = decay_start(t)
    length = max(t.steps - start, 1)
    shape = t.wsd_decay_shape

    def decay(count):
        progress = jnp.clip(count / length, 0.0, 1.0)
        if shape == "linear":
            frac = 1.0 - progress
        elif shape == "cosine":
            frac = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        else:  # 1-sqrt
            frac = 1.0 - jnp.sqrt(progress)
        return final + (t.peak_lr - final) * frac

    phases = [optax.linear_schedule(t.init_lr, t.peak_lr, warmup), optax.constant_schedule(t.peak_lr), decay]
    return optax.join_schedules(phases, [warmup, start])


def decay_mask(params):
    """Weight decay on weight matrices and embeddings only: not on norms, biases or mixing scalars."""

    def is_matrix(path, _):
        names = _names(path)
        return bool(names) and names[-1] in ("kernel", "embedding")

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def muon_dimensions(params):
    """Muon's view of each parameter: the hidden projections as matrices (input axes, output axes; the leading
    `layers` axis of the scanned stack is a batch axis, so each layer is orthogonalised on its own), None for
    what AdamW updates (embeddings, the LM head, norms, biases, the value-residual scalars)."""

    def dims(path, x):
        names = _names(path)
        if len(names) < 2 or names[-1] != "kernel":
            return None
        inputs = dict(_MATRIX_INPUT_AXES).get(names[-2])
        if inputs is None:
            return None
        batch = 1 if "layers" in names else 0  # scanned layers: [layers, ...]
        return MuonDimensionNumbers(
            reduction_axis=tuple(range(batch, batch + inputs)), output_axis=tuple(range(batch + inputs, x.ndim))
        )

    return jax.tree_util.tree_map_with_path(dims, params)


def muon_labels(params):
    """'muon' or 'adamw' per parameter."""
    is_dims = lambda x: x is None or isinstance(x, MuonDimensionNumbers)
    return jax.tree.map(lambda d: "adamw" if d is None else "muon", muon_dimensions(params), is_leaf=is_dims)


def muon_lr_schedule(t):
    """Muon's learning rate: the same schedule's shape, scaled from peak_lr to muon_lr."""
    base = lr_schedule(t)
    return lambda count: base(count) * (t.muon_lr / t.peak_lr)


def make_optimizer(t) -> optax.GradientTransformation:
    clip = optax.clip_by_global_norm(t.grad_clip)
    adamw = optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=decay_mask)
    if t.optimizer == "adamw":
        return optax.chain(clip, adamw)
    muon = optax.contrib.muon(
        muon_lr_schedule(t),
        beta=t.muon_momentum,
        weight_decay=t.weight_decay,
        muon_weight_dimension_numbers=muon_dimensions,
    )
    return optax.chain(clip, optax.partition({"muon": muon, "adamw": adamw}, muon_labels))


@dataclasses.dataclass(frozen=True)
class GroupSizes:
    """How many parameters each optimizer group updates (printed at start)."""

    muon: int
    adamw: int

    def describe(self, t) -> str:
        if t.optimizer == "adamw":
            return f"optimizer adamw on all {self.muon + self.adamw:,} parameters"
        return (
            f"optimizer muon on {self.muon:,} parameters (hidden matrices, lr {t.muon_lr:g}, momentum "
            f"{t.muon_momentum:g}), adamw on {self.adamw:,} (embeddings, LM head, norms, biases, scalars; lr "
            f"{t.peak_lr:g})"
        )


def group_sizes(params) -> GroupSizes:
    labels = jax.tree.leaves(muon_labels(params))
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(params)]
    muon = sum(n for n, label in zip(sizes, labels) if label == "muon")
    return GroupSizes(muon=muon, adamw=sum(sizes) - muon)
