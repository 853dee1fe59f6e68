"""The engine's sampler (engine/sampling.py) against plain sort-based references: the min-p, top-k and top-p sets,
the draw's frequencies, greedy's argmax and the log-probabilities, the logit bias and penalties."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import fast_few

from resformer_jax.engine import sampling
from resformer_jax.engine.sampling import SamplingParams


def reference_kept(x_V, temperature, top_k, top_p, min_p=0.0):
    """The tokens a row keeps, as vLLM's sampler orders it: min-p (probabilities at least min_p times the largest,
    its apply_min_p); then by sorting (what vLLM's and HF's samplers do) the logits at least the k-th largest;
    then, over a softmax of exactly those k largest, the smallest prefix reaching top_p and the ties of its last
    logit."""
    V = x_V.shape[0]
    s = x_V / (temperature if temperature > 0 else 1.0)
    if min_p > 0:
        p = np.exp(s.astype(np.float64) - s.max())
        s = np.where(p < min_p * p.max(), -np.inf, s)
    order = np.sort(s)[::-1]
    k = min(top_k, V) if top_k > 0 else V
    keep = (s >= order[k - 1]) & np.isfinite(s)  # a -inf logit stays ruled out
    if top_p < 1.0:
        top = order[:k].astype(np.float64)
        p = np.exp(top - top[0]) / np.exp(top - top[0]).sum()
        cut = min(int(np.sum(np.cumsum(p) < top_p)), k - 1)
        keep &= s >= top[cut]
    return keep


@pytest.mark.parametrize("by_sort", [False, True], ids=["bisection", "sort"])
@pytest.mark.parametrize("ties", fast_few([False, True], [True]))  # the fast tier: with ties, both ways
def test_top_k_and_top_p_keep_what_sorting_keeps(ties, by_sort):
    """Both ways the engine filters (bisection on a CPU or TPU, a sort on a GPU) keep the reference's tokens, min-p
    rows among them."""
    rng = np.random.default_rng(1 + ties)
    filtered = jax.jit(lambda *a: sampling.filtered_logits(*a, by_sort=by_sort))
    for _ in range(12):
        B, V = 16, int(rng.integers(2, 2000))
        x = (rng.standard_normal((B, V)) * rng.choice([0.5, 3.0, 10.0])).astype(np.float32)
        if ties:
            x = np.round(x)  # many equal logits, at the k-th and the nucleus's edge too
        x[::4, : V // 3] = -np.inf  # rows with tokens already ruled out
        temperature = rng.choice([0.5, 1.0, 2.0], B).astype(np.float32)
        top_k = rng.choice([0, 1, 2, 5, 50, V, V + 3], B).astype(np.int32)
        # top_p away from where float rounding of the mass could move the edge by a token
        top_p = rng.choice([1.0, 0.9, 0.5, 0.01], B).astype(np.float32)
        # min_p away from a probability ratio float rounding could put on either side
        min_p = rng.choice([0.0, 0.0, 0.05, 0.3], B).astype(np.float32)
        got = np.asarray(filtered(x, temperature, top_k, top_p, min_p))
        for b in range(B):
            want = reference_kept(x[b], temperature[b], top_k[b], top_p[b], min_p[b])
            np.testing.assert_array_equal(np.isfinite(got[b]), want, err_msg=f"row {b}: k={top_k[b]} p={top_p[b]}")
            np.testing.assert_array_equal(got[b][want], x[b][want] / temperature[b])


def test_the_draw_follows_the_kept_probabilities_and_never_takes_a_ruled_out_token():
    probs = np.array([0.05, 0.0, 0.4, 0.15, 0.3, 0.1])
    logits = np.where(probs > 0, np.log(np.maximum(probs, 1e-30)), -np.inf).astype(np.float32)
    n = 20_000
    keys = sampling.row_keys(jnp.full((n,), 7, jnp.uint32), jnp.arange(n, dtype=jnp.int32))
    tokens = np.asarray(jax.jit(sampling.draw)(keys, jnp.tile(jnp.asarray(logits), (n, 1))))
    freq = np.bincount(tokens, minlength=len(probs)) / n
    assert freq[1] == 0
    np.testing.assert_allclose(freq, probs, atol=0.015)  # 4 standard deviations at p = 0.4


def test_greedy_and_log_probabilities_equal_argmax_and_log_softmax():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 1000)).astype(np.float32)
    x[1, 5] = x[1, 900] = 50  # the first of two maxima
    x[2, 7] = x[2, 3] = np.nan  # the first NaN, as jnp.argmax
    x[3, :] = 1.0
    x[4, 10] = np.inf
    x[5, :] = -np.inf
    got = jax.jit(sampling.first_argmax)(x, jnp.max(x, axis=-1, keepdims=True))
    np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))
    y = (rng.standard_normal((8, 5000)) * 4).astype(np.float32)
    B = y.shape[0]
    temperature = jnp.where(jnp.arange(B) % 2 == 0, 0.0, 0.8)
    rows = sampling.SamplingRows(
        temperature,
        jnp.full((B,), 40, jnp.int32),
        jnp.full((B,), 0.9),
        jnp.zeros((B,)),
        jnp.arange(B, dtype=jnp.uint32),
        jnp.zeros((B,), jnp.int32),
    )
    token, logprob = jax.jit(sampling.sample_rows)(y, rows)
    np.testing.assert_array_equal(token[::2], np.argmax(y[::2], axis=-1))
    want = jnp.take_along_axis(jax.nn.log_softmax(y, axis=-1), token[:, None], axis=-1)[:, 0]
    np.testing.assert_array_equal(logprob, want)  # the model's log-probability, bit for bit
    top40 = np.argsort(-y, axis=-1)[:, :40]
    assert all(int(token[b]) in top40[b] for b in range(1, B, 2))


def test_logit_bias_then_penalties_as_vllm_orders_them():
    """penalized_logits adds each row's logit bias before vLLM's penalties (its Sampler: logits processors, then
    apply_penalties), a padding entry (bias 0) changing nothing; sample_rows's log-probability stays the model's."""
    from reference import penalize

    rng = np.random.default_rng(5)
    B, V = 3, 50
    x = rng.standard_normal((B, V)).astype(np.float32) * 3
    prompt, output = [1, 2, 3], [4, 4, 9]
    counts, seen = sampling.token_counts(jnp.asarray([prompt + output] * B), jnp.full((B,), 3), V)
    bias_ids = jnp.asarray([[9, 30, 0, 0], [0, 0, 0, 0], [4, 0, 0, 0]], jnp.int32)
    biases = jnp.asarray([[-100.0, 100.0, 0, 0], [0, 0, 0, 0], [5.0, 0, 0, 0]])
    weights = (jnp.full((B,), 0.5), jnp.full((B,), 0.25), jnp.full((B,), 1.3))
    penalties = sampling.Penalties(counts, seen, *weights, bias_ids, biases)
    got = np.asarray(sampling.penalized_logits(jnp.asarray(x), penalties))
    for b in range(B):
        biased = x[b].copy()
        for t, v in zip(np.asarray(bias_ids[b]), np.asarray(biases[b])):
            biased[t] += v
        np.testing.assert_allclose(got[b], penalize(biased, prompt, output, 0.5, 0.25, 1.3), rtol=1e-6)
    greedy = dataclasses.replace(sampling.SamplingRows.of(B, []), penalties=penalties)
    token, logprob = sampling.sample_rows(jnp.asarray(x), greedy)
    assert int(token[0]) == 30 and int(token[1]) == int(np.argmax(got[1]))
    want = np.take_along_axis(np.asarray(jax.nn.log_softmax(x, axis=-1)), np.asarray(token)[:, None], axis=-1)[:, 0]
    np.testing.assert_array_equal(logprob, want)


def test_min_tokens_masks_the_stop_ids_until_then_as_vllm_does():
    """A row's stop ids (the end-of-text id among them) cannot be drawn, greedy or sampled, while it has fewer
    than min_tokens new tokens (vLLM's MinTokensLogitsProcessor); from min_tokens on they can; a row without
    min_tokens is untouched; the log-probability stays the model's."""
    B, V = 4, 32
    x = np.zeros((B, V), np.float32)
    x[:, 7], x[:, 3], x[:, 5] = 9.0, 8.0, 1.0  # 7 (a stop id) the most likely, then 3 (another), then 5
    params = SamplingParams(stop_ids=(7, 3), min_tokens=2)
    rows = [(0, params, [1], []), (1, params, [1], [5]), (2, params, [1], [5, 5]), (3, SamplingParams(), [1], [])]
    s = sampling.SamplingRows.of(B, rows)
    token, logprob = jax.jit(sampling.sample_rows)(jnp.asarray(x), s)
    np.testing.assert_array_equal(token, [5, 5, 7, 7])  # 0 and 1 new tokens: both stop ids masked; 2: free
    want = jax.nn.log_softmax(jnp.asarray(x), axis=-1)[jnp.arange(B), token]
    np.testing.assert_allclose(logprob, want, rtol=1e-6)
    hot = dataclasses.replace(s, temperature_B=np.full((B,), 2.0, np.float32), seed_B=np.arange(B, dtype=np.uint32))
    drawn = []
    for _ in range(20):  # sampled at temperature 2 (7 and 3 hold most of the mass): never a stop id before min_tokens
        drawn.append(np.asarray(jax.jit(sampling.sample_rows)(jnp.asarray(x), hot)[0]))
        hot = dataclasses.replace(hot, seed_B=hot.seed_B + B)
    drawn = np.stack(drawn)
    assert not set(drawn[:, :2].ravel().tolist()) & {7, 3} and set(drawn[:, 2:].ravel().tolist()) & {7, 3}


def test_allowed_token_ids_leave_only_those_ids_to_draw():
    """A row naming allowed_token_ids (vLLM's) draws only among them, greedy (the most likely of them) or sampled at
    temperature 1 (every draw in the set though the set holds a small share of the mass); a row naming none draws
    from the whole vocabulary."""
    B, V = 3, 64
    x = np.random.default_rng(9).standard_normal((B, V)).astype(np.float32) * 2
    allowed = tuple(int(t) for t in np.argsort(x[0])[:20])  # the 20 least likely of row 0
    rows = [(0, SamplingParams(allowed_token_ids=allowed), [1], []), (1, SamplingParams(temperature=1.0,
            allowed_token_ids=allowed), [1], []), (2, SamplingParams(temperature=1.0), [1], [])]  # fmt: skip
    s = sampling.SamplingRows.of(B, rows)
    assert int(jax.jit(sampling.sample_rows)(jnp.asarray(x), s)[0][0]) == max(allowed, key=lambda t: x[0, t])
    drawn = []
    for seed in range(64):
        s = dataclasses.replace(s, seed_B=np.full((B,), seed, np.uint32))
        drawn.append(np.asarray(jax.jit(sampling.sample_rows)(jnp.asarray(x), s)[0]))
    drawn = np.stack(drawn)
    assert set(drawn[:, 1].tolist()) <= set(allowed) and len(set(drawn[:, 1].tolist())) > 1
    assert not set(drawn[:, 2].tolist()) <= set(allowed), "the unconstrained row drew only allowed ids"
