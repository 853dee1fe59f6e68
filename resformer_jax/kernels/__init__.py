"""The kernels: attention behind one function (attention.py: the dispatch), RMSNorm in the Pallas kernels or XLA's
fusions, and the layout helpers of a context axis that both the dispatch and the model use."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from resformer_jax.errors import UserError


class KernelUnavailable(UserError, RuntimeError):
    """A named attention impl cannot run here; the message says why."""


def scoped(fn):
    """Names the attention's ops (forward and backward) for the step profile (step_profile.py)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.named_scope("attention_kernel"):
            return fn(*args, **kwargs)

    return wrapped


def plain_rms_norm(h, scale_E, eps: float, out_dtype):
    """RMSNorm as XLA's fusions compute it: h * rsqrt(mean(h^2) + eps) * scale in fp32, cast to out_dtype (the
    model's norm off the kernels, and what they are checked and timed against)."""
    x = h.astype(jnp.float32)  # normalise in fp32 for stability
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * scale_E).astype(out_dtype)


def rms_norm(h_BxTxE, scale_E, *, eps, out_dtype, passes=False, outputs=1, mesh=None, batch_axes=("data", "fsdp")):
    """RMSNorm in the Pallas kernels (kernels/pallas_norm.py): y, or (h, y) with passes=True, where the residual
    stream goes on through h and the backward adds its gradient in the norm's own pass. Under a mesh it runs on
    each device's tokens (its shard of the batch, and of the sequence on a context axis), scale whole."""
    from resformer_jax.kernels import pallas_norm

    run = functools.partial(pallas_norm.rms_norm, eps=eps, out_dtype=out_dtype, passes=passes, outputs=outputs)
    if mesh is None or mesh.size == 1 or h_BxTxE.shape[0] % math.prod(mesh.shape[a] for a in batch_axes):
        return run(h_BxTxE, scale_E)  # one device, or a batch that does not divide (model.init's): whole
    spec = P(batch_axes, "context") if context_size(mesh) > 1 else P(batch_axes)
    return jax.shard_map(
        run, mesh=mesh, in_specs=(spec, P()), out_specs=(spec,) * (1 + outputs) if passes else spec, check_vma=False
    )(h_BxTxE, scale_E)


def context_size(mesh) -> int:
    """Devices each sequence is split over (the mesh's `context` axis; 1 without one)."""
    return int(dict(mesh.shape).get("context", 1)) if mesh is not None else 1


def on_context(x, mesh, batch_axes=("data", "fsdp"), split: bool = True):
    """x [B, T, ...] laid out with its batch over `batch_axes` and its tokens split over the `context` axis
    (split=False: every token on every device of the axis, an all-gather where it was split)."""
    spec = jax.sharding.PartitionSpec(batch_axes, "context" if split else None, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))
