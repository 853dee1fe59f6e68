"""AdamW + global-norm clipping + warmup-cosine schedule (paper Sec. 4.1.1), from optax."""

from __future__ import annotations

import jax
import optax


def lr_schedule(t):
    """Linear warmup from init_lr to peak_lr, then cosine to final_lr_ratio*peak at step `steps`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=t.init_lr,
        peak_value=t.peak_lr,
        warmup_steps=t.warmup_steps,
        decay_steps=t.steps,
        end_value=t.peak_lr * t.final_lr_ratio,
    )


def decay_mask(params):
    """Weight decay on weight matrices and embeddings only: not on norms, biases or mixing scalars."""

    def is_matrix(path, _):
        names = [k.key for k in path if hasattr(k, "key")]  # skips a logical-partitioning box's `.value`
        return bool(names) and names[-1] in ("kernel", "embedding")

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(t) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=decay_mask),
    )
