"""Sampling inside the compiled step, each row with its own settings, in vLLM's order: OpenAI's logit bias and
vLLM's repetition, frequency and presence penalties first, then greedy at temperature 0, otherwise temperature,
min-p, top-k and nucleus (top-p) over the top-k survivors; a row's randomness is its request's seed folded
with the index of the token it samples, so a request samples the same tokens in any batch.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from resformer_jax.kernels.names import target_backend

BISECTIONS = 32  # one halving per bit of a float32's order key: the threshold found is exact


def row_keys(seeds_B, counters_B):
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds_B, counters_B)


def order_key(x):
    """uint32 keys in the order of the float32s x (-0 taken as +0, -inf lowest): a >= b iff key(a) >= key(b)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def largest_key_where(lo_B, hi_B, holds):
    """Per row the largest key t in [lo, hi] with holds(t_Bx1) true, given that holds(lo) is true and holds is
    monotone (true up to some key, false above it): bisection over the keys, each halving one pass over the rows."""

    def halve(_, bounds):
        lo_B, hi_B = bounds
        mid_B = lo_B + (hi_B - lo_B) // 2 + (hi_B - lo_B) % 2  # the upper middle, without overflow
        ok_B = holds(mid_B[:, None])
        return jnp.where(ok_B, mid_B, lo_B), jnp.where(ok_B, hi_B, mid_B - 1)

    return jax.lax.fori_loop(0, BISECTIONS, halve, (lo_B, hi_B))[0]


def filtered_logits(logits_BxV, temperature_B, top_k_B, top_p_B, min_p_B, by_sort: bool | None = None):
    """Logits / temperature with the tokens outside each row's min-p, top-k and top-p set to -inf. Min-p (vLLM's)
    rules out a token less likely than min_p times the most likely one; the top-k are the logits at least the k-th
    largest (its ties kept); the nucleus is the smallest run of the top-k, largest first, whose probability (a
    softmax over exactly k of them) reaches top_p, and its last logit's ties. by_sort (default: on a GPU) finds
    both by sorting each row, else by bisection (`_bisected`)."""
    V = logits_BxV.shape[-1]
    scaled_BxV = logits_BxV / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
    # p < min_p * p_max, as log-probabilities: the softmax's normaliser cancels
    floor_Bx1 = jnp.max(scaled_BxV, axis=-1, keepdims=True) + jnp.log(jnp.where(min_p_B > 0, min_p_B, 1.0))[:, None]
    scaled_BxV = jnp.where((min_p_B[:, None] > 0) & (scaled_BxV < floor_Bx1), -jnp.inf, scaled_BxV)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
    if target_backend() == "gpu" if by_sort is None else by_sort:
        return _sorted(scaled_BxV, k_B, top_p_B)
    return _bisected(scaled_BxV, k_B, top_p_B)


def _sorted(scaled_BxV, k_B, top_p_B):
    V = scaled_BxV.shape[-1]
    sorted_BxV = -jnp.sort(-scaled_BxV, axis=-1)
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], axis=-1)
    kept_BxV = jnp.where(jnp.arange(V)[None] < k_B[:, None], sorted_BxV, -jnp.inf)
    cum_BxV = jnp.cumsum(jax.nn.softmax(kept_BxV, axis=-1), axis=-1)
    cut_B = jnp.minimum(jnp.sum(cum_BxV < top_p_B[:, None], axis=-1), V - 1)  # the prefix reaching top_p
    floor_Bx1 = jnp.where(top_p_B[:, None] < 1.0, jnp.take_along_axis(kept_BxV, cut_B[:, None], axis=-1), kth_Bx1)
    return jnp.where(scaled_BxV < jnp.maximum(floor_Bx1, kth_Bx1), -jnp.inf, scaled_BxV)


def _bisected(scaled_BxV, k_B, top_p_B):
    """The thresholds exact; the nucleus's mass summed in vocabulary order, so a mass within float rounding of
    top_p may take one token more or fewer than a sorted cumulative sum would. Each search runs only when some
    row asks for it."""
    V = scaled_BxV.shape[-1]
    lowest_B, highest_B = jnp.zeros_like(k_B, jnp.uint32), jnp.full_like(k_B, 2**32 - 1, jnp.uint32)
    keys_BxV = order_key(scaled_BxV)

    def kth_largest(_):
        return largest_key_where(lowest_B, highest_B, lambda t: jnp.sum(keys_BxV >= t, axis=-1) >= k_B)

    kth_B = jax.lax.cond(jnp.any(k_B < V), kth_largest, lambda _: lowest_B, None)  # key 0: every token
    e_BxV = jnp.exp(scaled_BxV - jnp.max(scaled_BxV, axis=-1, keepdims=True))

    def nucleus_floor(_):
        # the largest key above the k-th whose tokens at or above it hold top_p of the mass over exactly k tokens
        # (those above the k-th, then as many of its ties as fill k), else the k-th
        above_BxV = keys_BxV > kth_B[:, None]
        e_kth_B = jnp.max(jnp.where(keys_BxV == kth_B[:, None], e_BxV, 0.0), axis=-1)
        z_B = jnp.sum(jnp.where(above_BxV, e_BxV, 0.0), axis=-1) + (k_B - jnp.sum(above_BxV, axis=-1)) * e_kth_B
        reaches = lambda t: jnp.sum(jnp.where(keys_BxV >= t, e_BxV, 0.0), axis=-1) >= top_p_B * z_B
        return largest_key_where(kth_B, highest_B, lambda t: (t[:, 0] == kth_B) | reaches(t))

    nucleus_B = jax.lax.cond(jnp.any(top_p_B < 1.0), nucleus_floor, lambda _: kth_B, None)
    floor_B = jnp.where(top_p_B < 1.0, nucleus_B, kth_B)
    return jnp.where(keys_BxV >= floor_B[:, None], scaled_BxV, -jnp.inf)


def draw(keys, masked_BxV, block: int = 128):
    """One token a row from softmax(masked): a uniform number a row against the cumulative sum of the
    probabilities in vocabulary order (inverse CDF), in two levels (which block of `block` tokens, then which
    token of it: XLA:CPU's cumulative sum over a whole row is its slowest pass), never a token of probability 0."""
    B, V = masked_BxV.shape
    e_BxV = jnp.exp(masked_BxV - jnp.max(masked_BxV, axis=-1, keepdims=True))
    e_BxNxC = jnp.pad(e_BxV, ((0, 0), (0, -V % block))).reshape(B, -1, block)
    mass_BxN = jnp.sum(e_BxNxC, axis=-1)
    cum_BxN = jnp.cumsum(mass_BxN, axis=-1)
    target_B = jax.vmap(jax.random.uniform)(keys) * cum_BxN[:, -1]

    def last_positive(e_BxX):  # u * total can round up to the total: never past the last token that can be drawn
        return jnp.max(jnp.where(e_BxX > 0, jnp.arange(e_BxX.shape[-1]), 0), axis=-1)

    n_B = jnp.minimum(jnp.sum(cum_BxN <= target_B[:, None], axis=-1), last_positive(mass_BxN))
    before_B = jnp.where(n_B > 0, jnp.take_along_axis(cum_BxN, jnp.maximum(n_B - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    e_BxC = jnp.take_along_axis(e_BxNxC, n_B[:, None, None], axis=1)[:, 0]
    cum_BxC = before_B[:, None] + jnp.cumsum(e_BxC, axis=-1)
    c_B = jnp.minimum(jnp.sum(cum_BxC <= target_B[:, None], axis=-1), last_positive(e_BxC))
    return (n_B * block + c_B).astype(jnp.int32)


def first_argmax(x_BxV, max_Bx1):
    """jnp.argmax(x, -1) (the first maximum; the first NaN in a row holding one) given the rows' max, as two plain
    reductions: XLA:CPU runs argmax's variadic reduce element by element, at under half their speed."""
    iota_BxV = jax.lax.broadcasted_iota(jnp.int32, x_BxV.shape, 1)
    return jnp.min(jnp.where((x_BxV == max_Bx1) | jnp.isnan(x_BxV), iota_BxV, x_BxV.shape[-1]), axis=-1)


def token_counts(history_BxL, output_from_B, V: int):
    """(each token's count among a row's generated tokens [B, V] int32, whether it is in the row's prompt or
    generated tokens [B, V] bool) from the row's tokens so far (-1: padding), generated from output_from_B on."""
    B, L = history_BxL.shape
    real_BxL = history_BxL >= 0
    rows_BxL = jnp.broadcast_to(jnp.arange(B)[:, None], (B, L))
    ids_BxL = jnp.where(real_BxL, history_BxL, 0)
    generated_BxL = real_BxL & (jnp.arange(L)[None] >= output_from_B[:, None])
    counts_BxV = jnp.zeros((B, V), jnp.int32).at[rows_BxL, ids_BxL].add(generated_BxL.astype(jnp.int32))
    seen_BxV = jnp.zeros((B, V), jnp.int32).at[rows_BxL, ids_BxL].add(real_BxL.astype(jnp.int32)) > 0
    return counts_BxV, seen_BxV


def penalized_logits(logits_BxV, counts_BxV, seen_BxV, presence_B, frequency_B, repetition_B, bias_ids_BxK, bias_BxK):
    """OpenAI's logit bias (bias_BxK added to the logits of bias_ids_BxK; padding: bias 0), then vLLM's penalties
    (its apply_penalties): a token in the prompt or the output has a positive logit divided by the row's
    repetition penalty and a negative one multiplied by it; then frequency x its count in the output and presence
    (once, if it is there) are subtracted. Repetition 1, the others 0 and no bias leave the logits as they are."""
    rows_BxK = jnp.broadcast_to(jnp.arange(logits_BxV.shape[0])[:, None], bias_ids_BxK.shape)
    logits_BxV = logits_BxV.at[rows_BxK, bias_ids_BxK].add(bias_BxK.astype(logits_BxV.dtype))
    rep_BxV = jnp.where(seen_BxV, repetition_B[:, None], 1.0).astype(logits_BxV.dtype)
    x_BxV = jnp.where(logits_BxV > 0, logits_BxV / rep_BxV, logits_BxV * rep_BxV)
    counts_BxV = counts_BxV.astype(logits_BxV.dtype)
    return x_BxV - frequency_B[:, None] * counts_BxV - presence_B[:, None] * (counts_BxV > 0)


def sample_rows(logits_BxV, temperature_B, top_k_B, top_p_B, min_p_B, seeds_B, counters_B, penalties=()):
    """(token [B], its log-probability under the model [B], before any bias or penalty, as vLLM's raw logprobs):
    greedy rows by argmax; the filtering and the draw run only when some row samples. `penalties`: () or
    penalized_logits's (counts, seen, presence, frequency, repetition, bias ids, biases)."""
    max_Bx1 = jnp.max(logits_BxV, axis=-1, keepdims=True)
    chosen_BxV = penalized_logits(logits_BxV, *penalties) if penalties else logits_BxV
    greedy_B = first_argmax(chosen_BxV, jnp.max(chosen_BxV, axis=-1, keepdims=True) if penalties else max_Bx1)

    def sample(_):
        masked = filtered_logits(chosen_BxV, temperature_B, top_k_B, top_p_B, min_p_B)
        return jnp.where(temperature_B > 0, draw(row_keys(seeds_B, counters_B), masked), greedy_B)

    token_B = jax.lax.cond(jnp.any(temperature_B > 0), sample, lambda _: greedy_B, None)
    # log_softmax(logits)[token] as jax.nn.log_softmax forms it, for the sampled column only
    log_sum_B = jnp.log(jnp.sum(jnp.exp(logits_BxV - max_Bx1), axis=-1))
    picked_B = jnp.take_along_axis(logits_BxV, token_B[:, None], axis=-1)[:, 0]
    return token_B, (picked_B - max_Bx1[:, 0]) - log_sum_B
