"""Sampling inside the compiled step, each row with its own settings: greedy at temperature 0, otherwise
temperature, top-k and nucleus (top-p) over the top-k survivors; a row's randomness is its request's seed folded
with the index of the token it samples, so a request samples the same tokens in any batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(seeds_B, counters_B):
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds_B, counters_B)


def filtered_logits(logits_BxV, temperature_B, top_k_B, top_p_B):
    """Logits / temperature with the tokens outside each row's top-k and top-p set to -inf."""
    V = logits_BxV.shape[-1]
    scaled = logits_BxV / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
    sorted_BxV = -jnp.sort(-scaled, axis=-1)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth_Bx1, -jnp.inf, scaled)
    kept_BxV = jnp.where(jnp.arange(V)[None] < k_B[:, None], sorted_BxV, -jnp.inf)
    cum_BxV = jnp.cumsum(jax.nn.softmax(kept_BxV, axis=-1), axis=-1)
    # the smallest prefix whose mass reaches top_p (at least one token)
    cut_B = jnp.minimum(jnp.sum(cum_BxV < top_p_B[:, None], axis=-1), V - 1)
    cutoff_Bx1 = jnp.take_along_axis(kept_BxV, cut_B[:, None], axis=-1)
    return jnp.where((top_p_B[:, None] < 1.0) & (scaled < cutoff_Bx1), -jnp.inf, scaled)


def sample_rows(logits_BxV, temperature_B, top_k_B, top_p_B, seeds_B, counters_B):
    """(token [B], its log-probability under the model [B]): greedy rows by argmax; the filtering and the draw
    run only when some row samples."""
    greedy_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)

    def draw(_):
        keys = row_keys(seeds_B, counters_B)
        masked = filtered_logits(logits_BxV, temperature_B, top_k_B, top_p_B)
        drawn = jax.vmap(lambda k, lg: jax.random.categorical(k, lg))(keys, masked).astype(jnp.int32)
        return jnp.where(temperature_B > 0, drawn, greedy_B)

    token_B = jax.lax.cond(jnp.any(temperature_B > 0), draw, lambda _: greedy_B, None)
    logprob_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BxV, axis=-1), token_B[:, None], axis=-1)[:, 0]
    return token_B, logprob_B
