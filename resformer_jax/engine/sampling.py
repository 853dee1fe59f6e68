"""Sampling inside the compiled step, each row with its own settings, in vLLM's order: OpenAI's logit bias and
vLLM's repetition, frequency and presence penalties first, then greedy at temperature 0, otherwise temperature,
min-p, top-k and nucleus (top-p) over the top-k survivors; a row's randomness is its request's seed folded
with the index of the token it samples, so a request samples the same tokens in any batch.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from resformer_jax.engine.errors import EngineError
from resformer_jax.kernels.names import target_backend

BISECTIONS = 32  # one halving per bit of a float32's order key: the threshold found is exact
TOP_LOGPROBS = 20  # alternatives a scored position gives at most (vLLM's and OpenAI's maximum)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's decoding: greedy at temperature 0; `stop_ids` and `stop` strings end it (reason 'stop'; the
    stop id is in its tokens, not in its text unless include_stop_str_in_output); `max_tokens` new tokens at most
    ('length')."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # vLLM's stop strings: the text ends before the first (the engine's detokenizer)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string, or the stop id's text, kept in the text
    min_tokens: int = 0  # stops end the request only from this many new tokens on (the benchmarks' fixed lengths)
    logprobs: int | None = None  # the most likely N tokens at each generated position, beside the chosen one's
    prompt_logprobs: int | None = None  # each prompt token's log-probability and the N most likely there
    # vLLM's (and OpenAI's presence and frequency): subtracted from a token's logit once if it is in the output
    # so far, and per time it is there; a logit of a token in the prompt or the output divided by the repetition
    # penalty where positive, multiplied by it where negative (> 1 discourages repeating)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # vLLM's: a sampled token at least min_p times as likely as the most likely (0: off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's (token id, added to its logit) pairs, before penalties
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these ids may be generated (empty: any)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # vLLM's bad_words as token ids (`bad_words_ids`): never completed

    @property
    def masked(self) -> bool:
        """Whether the row needs the masked programs: tokens it may not draw at some step (MaskRows)."""
        return (self.min_tokens > 0 and bool(self.stop_ids)) or bool(self.allowed_token_ids or self.bad_words_ids)

    @property
    def penalized(self) -> bool:
        """Whether the row needs the penalized programs: a penalty or a logit bias."""
        penalty = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        return penalty or bool(self.logit_bias)

    def check(self, vocab_size: int | None = None) -> None:
        """EngineError naming the first setting out of its range; with `vocab_size`, a token id outside it too."""
        least = 0 if self.prompt_logprobs is not None else 1  # 0 new tokens: the prompt scored only
        if not isinstance(self.max_tokens, int) or self.max_tokens < least:
            raise EngineError(f"max_tokens={self.max_tokens!r}: must be a positive integer (new tokens to generate)")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (isinstance(n, int) and 0 <= n <= TOP_LOGPROBS):
                raise EngineError(f"{name}={n!r}: must be an integer in [0, {TOP_LOGPROBS}]")
        if not self.temperature >= 0:
            raise EngineError(f"temperature={self.temperature!r}: must be >= 0 (0: greedy)")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"top_p={self.top_p!r}: must be in (0, 1] (1: off)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise EngineError(f"top_k={self.top_k!r}: must be an integer >= 0 (0: off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise EngineError(f"{name}={getattr(self, name)!r}: must be in [-2, 2] (0: off)")
        if not 0 < self.repetition_penalty < float("inf"):
            raise EngineError(f"repetition_penalty={self.repetition_penalty!r}: must be a number > 0 (1: off)")
        if not 0 <= self.min_p <= 1:
            raise EngineError(f"min_p={self.min_p!r}: must be in [0, 1] (0: off)")
        if not all(math.isfinite(b) for _, b in self.logit_bias):
            raise EngineError("logit_bias: every bias must be a finite number")
        if vocab_size is None:
            return
        if outside := sorted(t for t, _ in self.logit_bias if not 0 <= t < vocab_size):
            raise EngineError(f"logit_bias names token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")
        if outside := sorted(t for t in self.allowed_token_ids if not 0 <= t < vocab_size):
            raise EngineError(f"allowed_token_ids holds ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")
        if any(not w for w in self.bad_words_ids):
            raise EngineError("bad_words: a word of no tokens; give each as text or at least one token id")
        if outside := sorted({t for w in self.bad_words_ids for t in w if not 0 <= t < vocab_size}):
            raise EngineError(f"bad_words hold ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")


@struct.dataclass
class SamplingRows:
    """Every per-row input of a step's sampler, as vLLM's SamplingMetadata carries them: the settings [B] each,
    the penalty rows and the masks (None where no row of the step has one: the programs without them pay
    nothing). Laid out once from the scheduled requests (`of`), passed whole into the step program and to
    `sample_rows`. A padding row samples greedily."""

    temperature_B: Any
    top_k_B: Any
    top_p_B: Any
    min_p_B: Any
    seed_B: Any
    counter_B: Any  # the index of the token the row samples (its generated tokens so far): its draw's counter
    penalties: Any = None  # PenaltyRows; inside a program, counted: Penalties
    masks: Any = None  # MaskRows

    @classmethod
    def of(cls, B: int, rows: Sequence[tuple[int, SamplingParams, list[int], list[int]]]) -> SamplingRows:
        """B rows from (slot, params, prompt, generated tokens) of each scheduled request; the rest padding."""
        x = cls(
            temperature_B=np.zeros((B,), np.float32),
            top_k_B=np.zeros((B,), np.int32),
            top_p_B=np.ones((B,), np.float32),
            min_p_B=np.zeros((B,), np.float32),
            seed_B=np.zeros((B,), np.uint32),
            counter_B=np.zeros((B,), np.int32),
            penalties=PenaltyRows.of(B, rows),
            masks=MaskRows.of(B, rows),
        )
        for i, s, _, generated in rows:
            x.temperature_B[i], x.top_k_B[i], x.top_p_B[i], x.min_p_B[i] = s.temperature, s.top_k, s.top_p, s.min_p
            x.seed_B[i], x.counter_B[i] = s.seed % 2**32, len(generated)
        return x

    @classmethod
    def shapes(cls, B: int) -> SamplingRows:
        S = jax.ShapeDtypeStruct
        f32, i32 = jnp.float32, jnp.int32
        return cls(S((B,), f32), S((B,), i32), S((B,), f32), S((B,), f32), S((B,), jnp.uint32), S((B,), i32))

    def counted(self, V: int) -> SamplingRows:
        """As a program samples with them: the penalty rows' tokens counted over the vocabulary (Penalties)."""
        return self if self.penalties is None else dataclasses.replace(self, penalties=self.penalties.counted(V))

    def after(self, token_B, live_B) -> SamplingRows:
        """The rows of the next step of a multi-step decode: each live row's sampled token joined to its text."""
        return dataclasses.replace(
            self,
            counter_B=self.counter_B + 1,
            penalties=None if self.penalties is None else self.penalties.with_token(token_B, live_B),
            masks=None if self.masks is None else self.masks.after(token_B, live_B),
        )


@struct.dataclass
class MaskRows:
    """The tokens each row may not draw, as vLLM's logits processors mask them (to -inf, before any penalty):
    its stop ids (the end-of-text id among them) while it has fewer than min_tokens new tokens (vLLM's
    MinTokensLogitsProcessor), every id outside its allowed_token_ids where it names some, and the last token of
    each bad word whose other tokens end the row's generated text (vLLM's NoBadWordsLogitsProcessor). `after`
    carries them to the next step of a multi-step decode."""

    stop_ids_BxS: Any  # -1: padding
    min_tokens_B: Any
    allowed_BxA: Any  # -1: padding; a row with none allows every id
    bad_BxJxW: Any  # each bad word's ids right-aligned, -1 before them (any token there matches)
    recent_BxW1: Any  # the row's last W - 1 generated ids, -2 before its first (matching no word's token)

    @classmethod
    def of(cls, B: int, rows: Sequence[tuple[int, SamplingParams, list[int], list[int]]]) -> MaskRows | None:
        """From (slot, params, prompt, generated) of each scheduled request; None where no row masks a token."""
        if not any(s.masked for _, s, _, _ in rows):
            return None
        S = bucket(max(len(s.stop_ids) for _, s, _, _ in rows), 4)
        A = bucket(max(len(s.allowed_token_ids) for _, s, _, _ in rows), 1)
        J = bucket(max(len(s.bad_words_ids) for _, s, _, _ in rows), 1)
        W = max([len(w) for _, s, _, _ in rows for w in s.bad_words_ids], default=1)
        x = cls(
            stop_ids_BxS=np.full((B, S), -1, np.int32),
            min_tokens_B=np.zeros((B,), np.int32),
            allowed_BxA=np.full((B, A), -1, np.int32),
            bad_BxJxW=np.full((B, J, W), -1, np.int32),
            recent_BxW1=np.full((B, W - 1), -2, np.int32),
        )
        for i, s, _, generated in rows:
            x.stop_ids_BxS[i, : len(s.stop_ids)], x.min_tokens_B[i] = s.stop_ids, s.min_tokens
            x.allowed_BxA[i, : len(s.allowed_token_ids)] = s.allowed_token_ids
            for j, word in enumerate(s.bad_words_ids):
                x.bad_BxJxW[i, j, W - len(word) :] = word
            tail = generated[len(generated) - (W - 1) :] if W > 1 else []
            x.recent_BxW1[i, W - 1 - len(tail) :] = tail
        return x

    def banned(self, V: int, generated_B):
        """[B, V] True where the row may not draw the token, given how many it has generated."""
        B = generated_B.shape[0]
        early_BxS = (generated_B < self.min_tokens_B)[:, None] & (self.stop_ids_BxS >= 0)
        named_BxA = self.allowed_BxA >= 0
        outside_BxV = jnp.any(named_BxA, axis=-1, keepdims=True) & ~_marked(B, V, self.allowed_BxA, named_BxA)
        prefix_BxJxW1, last_BxJ = self.bad_BxJxW[..., :-1], self.bad_BxJxW[..., -1]
        matched_BxJxW1 = (prefix_BxJxW1 == -1) | (prefix_BxJxW1 == self.recent_BxW1[:, None, :])
        completes_BxJ = jnp.all(matched_BxJxW1, axis=-1) & (last_BxJ >= 0)
        return _marked(B, V, self.stop_ids_BxS, early_BxS) | outside_BxV | _marked(B, V, last_BxJ, completes_BxJ)

    def after(self, token_B, live_B) -> MaskRows:
        """The masks of the next step, each live row's sampled token joined to its text."""
        if self.recent_BxW1.shape[-1] == 0:
            return self
        shifted_BxW1 = jnp.concatenate([self.recent_BxW1[:, 1:], token_B[:, None]], axis=-1)
        return dataclasses.replace(self, recent_BxW1=jnp.where(live_B[:, None], shifted_BxW1, self.recent_BxW1))


def bad_words_ids(encode: Callable[[str], list[int]], words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token ids, as its SamplingParams tokenizes them: each word as written (left-stripped)
    and, where a space before it makes other tokens of the same count, as it reads mid-text ("foo" and " foo")."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        out.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def _marked(B: int, V: int, ids_BxN, where_BxN):
    """[B, V] bool: True at ids_BxN[b, n] where where_BxN[b, n] (the rest of ids_BxN may be padding)."""
    rows_BxN = jnp.broadcast_to(jnp.arange(B)[:, None], ids_BxN.shape)
    marks = jnp.zeros((B, V), jnp.int32).at[rows_BxN, jnp.clip(ids_BxN, 0, V - 1)].max(where_BxN.astype(jnp.int32))
    return marks > 0


@struct.dataclass
class PenaltyRows:
    """The penalized programs' per-row inputs: each row's prompt and generated tokens so far (-1: padding), where
    its generated ones start, its presence, frequency and repetition penalties, and its logit bias (ids and values
    [B, K]; padding: bias 0 on token 0)."""

    history_BxL: Any
    output_from_B: Any
    presence_B: Any
    frequency_B: Any
    repetition_B: Any
    bias_ids_BxK: Any
    bias_BxK: Any

    @classmethod
    def of(cls, B: int, rows: Sequence[tuple[int, SamplingParams, list[int], list[int]]]) -> PenaltyRows | None:
        """From (slot, params, prompt, generated) of each scheduled request; None where no row asks for a penalty
        or a bias: the plain programs, which pay nothing for them."""
        if not any(s.penalized for _, s, _, _ in rows):
            return None
        L = bucket(max(len(p) + len(g) for _, _, p, g in rows), 16)
        K = bucket(max(len(s.logit_bias) for _, s, _, _ in rows), 4)
        x = cls(
            history_BxL=np.full((B, L), -1, np.int32),
            output_from_B=np.zeros((B,), np.int32),
            presence_B=np.zeros((B,), np.float32),
            frequency_B=np.zeros((B,), np.float32),
            repetition_B=np.ones((B,), np.float32),
            bias_ids_BxK=np.zeros((B, K), np.int32),
            bias_BxK=np.zeros((B, K), np.float32),
        )
        for i, s, prompt, generated in rows:
            seq = prompt + generated
            x.history_BxL[i, : len(seq)], x.output_from_B[i] = seq, len(prompt)
            x.presence_B[i], x.frequency_B[i] = s.presence_penalty, s.frequency_penalty
            x.repetition_B[i] = s.repetition_penalty
            for j, (t, b) in enumerate(s.logit_bias):
                x.bias_ids_BxK[i, j], x.bias_BxK[i, j] = t, b
        return x

    def counted(self, V: int) -> Penalties:
        counts_BxV, seen_BxV = token_counts(self.history_BxL, self.output_from_B, V)
        return Penalties(
            counts_BxV, seen_BxV, self.presence_B, self.frequency_B, self.repetition_B, self.bias_ids_BxK, self.bias_BxK
        )


@struct.dataclass
class Penalties:
    """PenaltyRows inside the program: each token's count among a row's generated tokens and whether the row has
    it at all [B, V], with the row's weights and bias."""

    counts_BxV: Any
    seen_BxV: Any
    presence_B: Any
    frequency_B: Any
    repetition_B: Any
    bias_ids_BxK: Any
    bias_BxK: Any

    def with_token(self, token_B, live_B) -> Penalties:
        """The counts after each live row's sampled token joins its output."""
        rows_B = jnp.arange(token_B.shape[0])
        counts = self.counts_BxV.at[rows_B, token_B].add(live_B.astype(jnp.int32))
        seen = self.seen_BxV.at[rows_B, token_B].set(self.seen_BxV[rows_B, token_B] | live_B)
        return dataclasses.replace(self, counts_BxV=counts, seen_BxV=seen)


def bucket(n: int, at_least: int = 1, base: int = 2) -> int:
    """The power of `base` >= n (and >= at_least): the shapes a step is compiled for."""
    b = 1
    while b < n:
        b *= base
    return max(at_least, b)


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


def penalized_logits(logits_BxV, p: Penalties):
    """OpenAI's logit bias (p.bias_BxK added to the logits of p.bias_ids_BxK; padding: bias 0), then vLLM's
    penalties (its apply_penalties): a token in the prompt or the output has a positive logit divided by the row's
    repetition penalty and a negative one multiplied by it; then frequency x its count in the output and presence
    (once, if it is there) are subtracted. Repetition 1, the others 0 and no bias leave the logits as they are."""
    rows_BxK = jnp.broadcast_to(jnp.arange(logits_BxV.shape[0])[:, None], p.bias_ids_BxK.shape)
    logits_BxV = logits_BxV.at[rows_BxK, p.bias_ids_BxK].add(p.bias_BxK.astype(logits_BxV.dtype))
    rep_BxV = jnp.where(p.seen_BxV, p.repetition_B[:, None], 1.0).astype(logits_BxV.dtype)
    x_BxV = jnp.where(logits_BxV > 0, logits_BxV / rep_BxV, logits_BxV * rep_BxV)
    counts_BxV = p.counts_BxV.astype(logits_BxV.dtype)
    return x_BxV - p.frequency_B[:, None] * counts_BxV - p.presence_B[:, None] * (counts_BxV > 0)


def sample_rows(logits_BxV, s: SamplingRows):
    """(token [B], its log-probability under the model [B], before any mask, bias or penalty, as vLLM's raw
    logprobs): greedy rows by argmax; the filtering and the draw run only when some row samples. A masked token
    is never drawn, greedy or not. `s` as counted (SamplingRows.counted)."""
    max_Bx1 = jnp.max(logits_BxV, axis=-1, keepdims=True)
    chosen_BxV = logits_BxV
    if s.masks is not None:
        chosen_BxV = jnp.where(s.masks.banned(logits_BxV.shape[-1], s.counter_B), -jnp.inf, chosen_BxV)
    if s.penalties is not None:
        chosen_BxV = penalized_logits(chosen_BxV, s.penalties)
    plain = s.masks is None and s.penalties is None
    greedy_B = first_argmax(chosen_BxV, max_Bx1 if plain else jnp.max(chosen_BxV, axis=-1, keepdims=True))

    def sample(_):
        masked = filtered_logits(chosen_BxV, s.temperature_B, s.top_k_B, s.top_p_B, s.min_p_B)
        return jnp.where(s.temperature_B > 0, draw(row_keys(s.seed_B, s.counter_B), masked), greedy_B)

    token_B = jax.lax.cond(jnp.any(s.temperature_B > 0), sample, lambda _: greedy_B, None)
    # log_softmax(logits)[token] as jax.nn.log_softmax forms it, for the sampled column only
    log_sum_B = jnp.log(jnp.sum(jnp.exp(logits_BxV - max_Bx1), axis=-1))
    picked_B = jnp.take_along_axis(logits_BxV, token_B[:, None], axis=-1)[:, 0]
    return token_B, (picked_B - max_Bx1[:, 0]) - log_sum_B
