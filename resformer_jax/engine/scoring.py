"""A sequence's log-probabilities under the model, position by position: what OpenAI's `echo` with `logprobs`
returns for a prompt (lm-eval scores log-likelihood tasks with it) and `top_logprobs` for every position. The
model's whole-sequence forward over the engine's own parameters (no cache: each position reads the exact prefix),
compiled once per power-of-two length."""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np

from resformer_jax.engine.engine import Engine, bucket
from resformer_jax.model.transformer import Transformer

TOP = 20  # alternatives computed a position (the API's maximum); a request takes its first N


@dataclasses.dataclass(frozen=True)
class Scored:
    """Per position i of a sequence: log p(token_i | tokens before it) (None at 0), and the TOP most likely
    tokens there with their log-probabilities, most likely first (None at 0)."""

    token_logprobs: list[float | None]
    top_ids: list[list[int] | None]
    top_logprobs: list[list[float] | None]


class PromptScorer:
    """Scores token sequences with `engine`'s model and parameters; safe to call from any thread (one at a
    time)."""

    def __init__(self, engine: Engine):
        m = engine.model_cfg
        self.max_len, self.vocab = engine.max_len, m.vocab_size
        params = engine.params
        if "lm_head" in params and params["lm_head"]["kernel"].shape[-1] != m.vocab_size:  # a GPU's padded head
            head = params["lm_head"]
            params = {**params, "lm_head": {**head, "kernel": head["kernel"][:, : m.vocab_size]}}
        self._params = params
        model = Transformer(m)

        def score(params, tokens_1xT):
            logp_TxV = jax.nn.log_softmax(model.apply({"params": params}, tokens_1xT)[0].astype(jnp.float32), -1)
            next_T = jnp.roll(tokens_1xT[0], -1)  # position t's logits predict token t + 1
            chosen_T = jnp.take_along_axis(logp_TxV, next_T[:, None], axis=1)[:, 0]
            top_lp, top_id = jax.lax.top_k(logp_TxV, min(TOP, m.vocab_size))
            return chosen_T, top_lp, top_id

        self._score = jax.jit(score)
        self._lock = threading.Lock()

    def score(self, tokens: list[int]) -> Scored:
        T = len(tokens)
        if not 1 <= T <= self.max_len:
            raise ValueError(f"a sequence of {T} tokens: the model scores 1 to {self.max_len}")
        padded = np.zeros((1, min(bucket(T, at_least=16), self.max_len)), np.int32)
        padded[0, :T] = tokens  # causal: the padding after the sequence changes none of its positions
        with self._lock:
            chosen, top_lp, top_id = jax.device_get(self._score(self._params, padded))
        token_logprobs: list[float | None] = [None] + [float(x) for x in chosen[: T - 1]]
        ids: list[list[int] | None] = [None] + [[int(i) for i in row] for row in top_id[: T - 1]]
        lps: list[list[float] | None] = [None] + [[float(x) for x in row] for row in top_lp[: T - 1]]
        return Scored(token_logprobs, ids, lps)
