"""Train state, loss, and the jitted train/eval steps with microbatch accumulation."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from resformer_jax import kernels
from resformer_jax.config import LOSS_CHUNK_LEN
from resformer_jax.model.layers import uses_cpu_matmuls
from resformer_jax.model.transformer import attended_fraction, output_embedding
from resformer_jax.train.loss import chunked_lm_loss, cross_entropy, cross_entropy_and_z, head_plan
from resformer_jax.train.telemetry import step_telemetry


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    # Steps whose loss or gradient was non-finite (update skipped), and the first such step (-1: none).
    nonfinite_count: jax.Array
    first_nonfinite_step: jax.Array
    spikes: Any = None  # SpikeWindow with train.spike_sigma > 0 (None adds nothing to the state or checkpoints)


@struct.dataclass
class SpikeWindow:
    """The loss and gradient norm of the last `window` applied steps (a ring), and how many spikes were skipped."""

    losses: jax.Array  # [window] fp32
    grad_norms: jax.Array  # [window] fp32
    filled: jax.Array  # applied steps recorded so far (the ring holds min(filled, window))
    skipped: jax.Array  # steps not applied as spikes

    @classmethod
    def empty(cls, window: int) -> SpikeWindow:
        zeros = jnp.zeros((window,), jnp.float32)
        return cls(zeros, zeros, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    def is_spike(self, loss, grad_norm, sigma: float, min_filled: int):
        """Whether this step's loss or gradient norm is more than `sigma` standard deviations above the window's
        mean (once at least `min_filled` steps are recorded)."""
        window = self.losses.shape[0]
        n = jnp.minimum(self.filled, window)
        valid = jnp.arange(window) < n

        def above(values, x):
            mean = jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(n, 1)
            var = jnp.sum(jnp.where(valid, (values - mean) ** 2, 0.0)) / jnp.maximum(n, 1)
            return x > mean + sigma * jnp.sqrt(var)

        return (n >= min_filled) & (above(self.losses, loss) | above(self.grad_norms, grad_norm))

    def record(self, loss, grad_norm, applied, spike) -> SpikeWindow:
        at = self.filled % self.losses.shape[0]
        put = lambda ring, x: jnp.where(applied, ring.at[at].set(x.astype(jnp.float32)), ring)
        return SpikeWindow(
            put(self.losses, loss),
            put(self.grad_norms, grad_norm),
            self.filled + applied.astype(jnp.int32),
            self.skipped + spike.astype(jnp.int32),
        )


def init_state(model, tx, rng, seq_len: int, spike_window: int = 0):
    """Boxed (logically partitioned) state; unbox with nn.unbox after reading the specs."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(rng, tokens)["params"]
    opt_state = tx.init(params)  # boxed: moments inherit the parameters' logical axes (FSDP-sharded)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        nonfinite_count=jnp.zeros((), jnp.int32),
        first_nonfinite_step=jnp.full((), -1, jnp.int32),
        spikes=SpikeWindow.empty(spike_window) if spike_window else None,
    )


def lm_loss(
    params,
    model,
    tokens_BxTp1,
    chunk_len: int = LOSS_CHUNK_LEN,
    dropout_rng=None,
    z_loss: float = 0.0,
    document_starts: bool = True,
    rows_B=None,
):
    """(the loss to minimise, mean log Z^2 for logging): next-token cross entropy, plus z_loss times the mean
    squared log-normaliser of the logits (PaLM's z-loss) where z_loss > 0. Sequences hold seq_len + 1 tokens:
    inputs are [:-1], targets [1:].

    chunk_len > 0: the LM head and cross entropy run fused, chunk_len positions
    at a time (train/loss.py); 0: full logits, then cross entropy. dropout_rng: training with
    model.dropout > 0 (evaluation passes none: no dropout). document_starts=False (packed documents,
    model.document_eot): the target after an end-of-text token, a document's first token predicted from the
    previous document's end, is left out, and the mean is over the targets kept. rows_B (bool, evaluation's
    last batch): only these rows' targets count.
    """
    inputs_BxT, targets_BxT = tokens_BxTp1[:, :-1], tokens_BxTp1[:, 1:]
    left_out_BxT = targets_left_out(model, inputs_BxT, document_starts, rows_B)
    if left_out_BxT is None:
        return _lm_loss(params, model, inputs_BxT, targets_BxT, chunk_len, dropout_rng, z_loss)
    targets_BxT = jnp.where(left_out_BxT, -1, targets_BxT)  # -1: ignored by both losses
    scale = targets_BxT.size / jnp.maximum(targets_BxT.size - left_out_BxT.sum(), 1)
    loss, z_mean = _lm_loss(params, model, inputs_BxT, targets_BxT, chunk_len, dropout_rng, z_loss)
    return loss * scale, z_mean * scale


def targets_left_out(model, inputs_BxT, document_starts: bool, rows_B=None):
    """Which targets lm_loss leaves out [B, T] (None: none): those after an end-of-text token where
    document_starts is False, and every target of a row outside rows_B."""
    eot = model.cfg.document_eot
    left_out_BxT = None if document_starts or eot < 0 else inputs_BxT == eot
    if rows_B is not None:
        outside_BxT = jnp.broadcast_to(~rows_B[:, None], inputs_BxT.shape)
        left_out_BxT = outside_BxT if left_out_BxT is None else left_out_BxT | outside_BxT
    return left_out_BxT


def _lm_loss(params, model, inputs_BxT, targets_BxT, chunk_len, dropout_rng, z_loss):
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
    if chunk_len <= 0:
        logits = model.apply({"params": params}, inputs_BxT, rngs=rngs)
        with jax.named_scope("lm_head_xent"):
            if not z_loss:
                return cross_entropy(logits, targets_BxT), jnp.zeros((), jnp.float32)
            ce, z_mean = cross_entropy_and_z(logits, targets_BxT)
            return ce + z_loss * z_mean, jax.lax.stop_gradient(z_mean)
    h_BxTxE = model.apply({"params": params}, inputs_BxT, return_hidden=True, rngs=rngs)
    if model.context_parallel(h_BxTxE.shape[0]):  # the LM head's block loop over each device's own tokens
        h_BxTxE, targets_BxT = (_context_rows(x, model.mesh) for x in (h_BxTxE, targets_BxT))
    with jax.named_scope("lm_head_xent"):  # named for the step profile (step_profile.py)
        w_ExV = output_embedding(params, model.cfg)
        plan = head_plan(uses_cpu_matmuls(model.cfg.matmuls))
        loss, z_mean = chunked_lm_loss(h_BxTxE, w_ExV, targets_BxT, chunk_len, z_loss, plan)
        return loss, jax.lax.stop_gradient(z_mean)


def _context_rows(x_BxTx, mesh):
    """[B, T, ...] split over the mesh's context axis -> [B * N, T / N, ...]: each device's slice of each sequence
    a row of its own (the mean over tokens unchanged), laid out over every mesh axis."""
    B, T, N = x_BxTx.shape[0], x_BxTx.shape[1], kernels.context_size(mesh)
    rows = x_BxTx.reshape(B * N, T // N, *x_BxTx.shape[2:])
    spec = P(("data", "fsdp", "context"), *([None] * (rows.ndim - 1)))
    return jax.lax.with_sharding_constraint(rows, NamedSharding(mesh, spec))


def loss_fn(params, model, tokens_BxTp1, chunk_len: int = LOSS_CHUNK_LEN, dropout_rng=None, document_starts=True):
    """The mean next-token cross entropy (what evaluation reports)."""
    return lm_loss(params, model, tokens_BxTp1, chunk_len, dropout_rng, document_starts=document_starts)[0]


def apply_if_ok(state: TrainState, grads, loss, tx, spike_sigma: float):
    """The optimizer's update, applied only when the loss and gradient are finite and (a SpikeWindow in the state)
    not a spike: (the new state, the gradient's norm, finite, spike)."""
    with jax.named_scope("optimizer"):  # named for the step profile (step_profile.py)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt = tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        spikes, spike = state.spikes, jnp.zeros((), bool)
        if spikes is not None:
            spike = finite & spikes.is_spike(loss, grad_norm, spike_sigma, min(spikes.losses.shape[0], 10))
            spikes = spikes.record(loss, grad_norm, finite & ~spike, spike)
        ok = finite & ~spike
        # A step not applied never touches the parameters or the optimizer state.
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        new_state = dataclasses.replace(
            state,
            step=state.step + 1,
            params=keep(new_params, state.params),
            opt_state=keep(new_opt, state.opt_state),
            nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
            first_nonfinite_step=jnp.where(
                (state.first_nonfinite_step < 0) & ~finite, state.step, state.first_nonfinite_step
            ),
            spikes=spikes,
        )
    return new_state, grad_norm, finite, spike


def make_train_step(
    model,
    tx,
    num_microbatches: int,
    batch_sharding=None,
    loss_chunk_len: int = LOSS_CHUNK_LEN,
    dropout_seed: int = 0,
    z_loss: float = 0.0,
    spike_sigma: float = 0.0,
    telemetry: bool = False,
    document_starts: bool = True,
):
    """One optimizer step over the global batch, accumulating grads over microbatches with lax.scan. With
    model.dropout > 0 the dropout key is a function of (seed, step, microbatch), so a resumed run drops the same
    units as an uninterrupted one. A step is not applied when its loss or gradient is non-finite, or (spike_sigma
    > 0, the state holding a SpikeWindow) when either is a spike against the recent applied steps. telemetry: the
    per-layer norms in the metrics (a second program, run on logged steps only: train/setup.py)."""
    grad_fn = jax.value_and_grad(
        lambda p, model, t, r: lm_loss(p, model, t, loss_chunk_len, r, z_loss, document_starts), has_aux=True
    )
    uses_dropout = model.cfg.dropout > 0

    def dropout_key(step, micro):
        if not uses_dropout:
            return None
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(dropout_seed), step), micro)

    def train_step(state: TrainState, tokens_BxTp1):
        if num_microbatches == 1:
            (loss, z_mean), grads = grad_fn(state.params, model, tokens_BxTp1, dropout_key(state.step, 0))
        else:
            B = tokens_BxTp1.shape[0]
            M = B // num_microbatches
            # Microbatch a takes rows {m * A + a}: every device contributes rows to every microbatch.
            micro_AxMxT = tokens_BxTp1.reshape(M, num_microbatches, -1).swapaxes(0, 1)
            if batch_sharding is not None:
                micro_AxMxT = jax.lax.with_sharding_constraint(micro_AxMxT, batch_sharding)

            def body(acc, xs):
                mb, i = xs
                (loss, z_mean), grads = grad_fn(state.params, model, mb, dropout_key(state.step, i))
                return jax.tree.map(jnp.add, acc, (loss, z_mean, grads)), None

            zero = jnp.zeros((), jnp.float32)
            zeros = (zero, zero, jax.tree.map(jnp.zeros_like, state.params))
            (loss, z_mean, grads), _ = jax.lax.scan(body, zeros, (micro_AxMxT, jnp.arange(num_microbatches)))
            loss, z_mean, grads = jax.tree.map(lambda x: x / num_microbatches, (loss, z_mean, grads))
        new_state, grad_norm, finite, spike = apply_if_ok(state, grads, loss, tx, spike_sigma)
        spikes = new_state.spikes
        metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
        if z_loss:
            metrics["z_loss"] = z_mean
        if model.cfg.document_eot >= 0:  # packed documents masked: the attention pairs kept, for the MFU
            metrics["attended_fraction"] = attended_fraction(tokens_BxTp1[:, :-1], model.cfg.document_eot)
        if spikes is not None:
            metrics["spike"] = spike.astype(jnp.int32)
        if telemetry:
            with jax.named_scope("telemetry"):
                metrics["telemetry"] = step_telemetry(grads, state.params, new_state.params, model.cfg.num_layers)
        return new_state, metrics

    return train_step


def make_eval_step(model, loss_chunk_len: int = LOSS_CHUNK_LEN, document_starts: bool = True):
    def eval_step(params, tokens_BxTp1, rows_B=None):
        """(the mean loss over the targets counted, how many were counted): a split's loss weights each batch
        by its count."""
        loss = lm_loss(params, model, tokens_BxTp1, loss_chunk_len, None, 0.0, document_starts, rows_B)[0]
        left_out_BxT = targets_left_out(model, tokens_BxTp1[:, :-1], document_starts, rows_B)
        counted = tokens_BxTp1[:, 1:].size - (0 if left_out_BxT is None else left_out_BxT.sum())
        return loss, jnp.asarray(counted, jnp.int32)

    return eval_step
