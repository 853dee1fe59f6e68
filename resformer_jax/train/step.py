"""Train state, loss, and the jitted train/eval steps with microbatch accumulation."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from resformer_jax.config import LOSS_CHUNK_LEN
from resformer_jax.model.transformer import output_embedding
from resformer_jax.train.loss import chunked_cross_entropy, cross_entropy


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    # Steps whose loss or gradient was non-finite (update skipped), and the first such step (-1: none).
    nonfinite_count: jax.Array
    first_nonfinite_step: jax.Array


def init_state(model, tx, rng, seq_len: int):
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
    )


def loss_fn(params, model, tokens_BxTp1, chunk_len: int = LOSS_CHUNK_LEN, dropout_rng=None):
    """Sequences hold seq_len + 1 tokens: inputs are [:-1], targets [1:].

    chunk_len > 0: the LM head and cross entropy run fused, chunk_len positions
    at a time (train/loss.py); 0: full logits, then cross entropy. dropout_rng: training with
    model.dropout > 0 (evaluation passes none: no dropout).
    """
    inputs_BxT, targets_BxT = tokens_BxTp1[:, :-1], tokens_BxTp1[:, 1:]
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
    if chunk_len <= 0:
        logits = model.apply({"params": params}, inputs_BxT, rngs=rngs)
        with jax.named_scope("lm_head_xent"):
            return cross_entropy(logits, targets_BxT)
    h_BxTxE = model.apply({"params": params}, inputs_BxT, return_hidden=True, rngs=rngs)
    with jax.named_scope("lm_head_xent"):  # named for the step profile (step_profile.py)
        w_ExV = output_embedding(params, model.cfg)
        return chunked_cross_entropy(h_BxTxE, w_ExV, targets_BxT, chunk_len)


def make_train_step(
    model,
    tx,
    num_microbatches: int,
    batch_sharding=None,
    loss_chunk_len: int = LOSS_CHUNK_LEN,
    dropout_seed: int = 0,
):
    """One optimizer step over the global batch, accumulating grads over microbatches with lax.scan. With
    model.dropout > 0 the dropout key is a function of (seed, step, microbatch), so a resumed run drops the same
    units as an uninterrupted one."""
    grad_fn = jax.value_and_grad(lambda p, model, t, r: loss_fn(p, model, t, loss_chunk_len, r))
    uses_dropout = model.cfg.dropout > 0

    def dropout_key(step, micro):
        if not uses_dropout:
            return None
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(dropout_seed), step), micro)

    def train_step(state: TrainState, tokens_BxTp1):
        if num_microbatches == 1:
            loss, grads = grad_fn(state.params, model, tokens_BxTp1, dropout_key(state.step, 0))
        else:
            B = tokens_BxTp1.shape[0]
            M = B // num_microbatches
            # Microbatch a takes rows {m * A + a}: every device contributes rows to every microbatch.
            micro_AxMxT = tokens_BxTp1.reshape(M, num_microbatches, -1).swapaxes(0, 1)
            if batch_sharding is not None:
                micro_AxMxT = jax.lax.with_sharding_constraint(micro_AxMxT, batch_sharding)

            def body(acc, xs):
                mb, i = xs
                loss, grads = grad_fn(state.params, model, mb, dropout_key(state.step, i))
                return jax.tree.map(jnp.add, acc, (loss, grads)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
            (loss, grads), _ = jax.lax.scan(body, zeros, (micro_AxMxT, jnp.arange(num_microbatches)))
            loss, grads = jax.tree.map(lambda x: x / num_microbatches, (loss, grads))
        with jax.named_scope("optimizer"):  # named for the step profile (step_profile.py)
            grad_norm = optax.tree.norm(grads)
            updates, new_opt = tx.update(grads, state.opt_state, state.params)
            new_params = optax.apply_updates(state.params, updates)
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            # A non-finite step never touches the state: the last good state stays intact.
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
            new_state = dataclasses.replace(
                state,
                step=state.step + 1,
                params=keep(new_params, state.params),
                opt_state=keep(new_opt, state.opt_state),
                nonfinite_count=state.nonfinite_count + (~ok).astype(jnp.int32),
                first_nonfinite_step=jnp.where(
                    (state.first_nonfinite_step < 0) & ~ok, state.step, state.first_nonfinite_step
                ),
            )
        metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": (~ok).astype(jnp.int32)}
        return new_state, metrics

    return train_step


def make_eval_step(model, loss_chunk_len: int = LOSS_CHUNK_LEN):
    def eval_step(params, tokens_BxTp1):
        return loss_fn(params, model, tokens_BxTp1, loss_chunk_len)

    return eval_step
