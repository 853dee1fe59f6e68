"""Log-likelihoods of continuations given contexts: what zero-shot evaluation (`evaluate --tasks`) and the
lm-evaluation-harness adapter both score, in one place.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from resformer_jax.model import Transformer
from resformer_jax.model.transformer import lm_head_logits


def buckets(max_len: int, smallest: int = 32) -> list[int]:
    """Powers of two from `smallest` below `max_len`, then `max_len`."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


def prepare(context_ids: list[int], continuation_ids: list[int], max_len: int) -> tuple[list[int], int]:
    """(tokens to run, how many of the last ones are scored): context + continuation with the context cut from
    the left so that at most max_len tokens are fed (the last token is only a target)."""
    ids = (list(context_ids) + list(continuation_ids))[-(max_len + 1) :]
    return ids, min(len(continuation_ids), len(ids) - 1)


def rows_per_batch(m, T: int, K: int, budget_bytes: float, most: int) -> int:
    """The most rows (a power of two, at most `most`) whose forward fits `budget_bytes`: per row, a layer's
    activations in fp32 ([T, 8E + 3F]), one attention matrix per head in the worst case ([H, T, T]) and the
    head's logits at K positions twice (logits and their exponentials)."""
    per_row = 4 * (T * (8 * m.d_model + 3 * m.ffn_dim) + m.num_heads * T * T + 2 * K * m.vocab_size)
    rows = 1
    while rows * 2 <= most and rows * 2 * per_row <= budget_bytes:
        rows *= 2
    return rows


@dataclasses.dataclass
class ScoreProgress:
    """Counts a long scoring call reports while it runs."""

    done: int
    total: int
    seconds: float


class ContinuationScorer:
    """scorer(requests) -> [(sum of log p over the scored tokens, whether each is the greedy token)].

    `batch`: rows per forward pass (0: sized to `memory_budget_gb` per bucket). `mesh`: the parameters' mesh when
    they are sharded across processes (a multi-host run scoring in its loop): every process then feeds the same
    requests, replicated, and reads its own copy of the replicated result."""

    def __init__(self, model_cfg, params, max_len: int, batch: int = 0, memory_budget_gb: float = 1.0, mesh=None):
        self.m, self.params, self.max_len = model_cfg, params, max_len
        self.batch, self.budget = batch, memory_budget_gb * 2**30
        self.buckets = buckets(max_len)
        model = Transformer(model_cfg)

        def score(params, tokens_BxT, positions_BxK, targets_BxK):
            h_BxTxE = model.apply({"params": params}, tokens_BxT, return_hidden=True)
            h_BxKxE = jnp.take_along_axis(h_BxTxE, positions_BxK[..., None], axis=1)
            logits_BxKxV = lm_head_logits(model_cfg, params, h_BxKxE)
            target_BxK = jnp.take_along_axis(logits_BxKxV, targets_BxK[..., None], axis=-1)[..., 0]
            logp_BxK = target_BxK - jax.nn.logsumexp(logits_BxKxV, axis=-1)
            return logp_BxK, logits_BxKxV.argmax(-1) == targets_BxK

        if mesh is None:
            self._score = jax.jit(score)
            self._place: Callable[[Any], Any] = lambda x: x
            self._fetch: Callable[[Any], np.ndarray] = np.asarray
        else:
            rep = NamedSharding(mesh, PartitionSpec())
            self._score = jax.jit(score, out_shardings=(rep, rep))
            self._place = lambda x: jax.make_array_from_process_local_data(rep, x, x.shape)
            self._fetch = lambda x: np.asarray(x.addressable_data(0))

    def rows(self, T: int, K: int) -> int:
        return self.batch or rows_per_batch(self.m, T, K, self.budget, most=64)

    def __call__(
        self, requests: list[tuple[list[int], int]], progress: Callable[[ScoreProgress], Any] | None = None
    ) -> list[tuple[float, bool]]:
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        longest_cont = max((n for _, n in requests), default=1)
        t0, b = time.perf_counter(), 0
        while b < len(order):
            T = next(x for x in self.buckets if x >= len(requests[order[b]][0]) - 1)  # the batch's longest first
            B = self.rows(T, min(T, longest_cont))  # rows fixed per length bucket: one program per (T, K)
            idx = order[b : b + B]
            K = next(x for x in buckets(T, 8) if x >= max(requests[i][1] for i in idx))
            toks, pos, tgt = (np.zeros((B, n), np.int32) for n in (T, K, K))
            for r, i in enumerate(idx):
                ids, n = requests[i]
                toks[r, : len(ids) - 1] = ids[:-1]
                pos[r, :n] = np.arange(len(ids) - 1 - n, len(ids) - 1)  # position j predicts token j + 1
                tgt[r, :n] = ids[len(ids) - n :]
            scored = self._score(self.params, *(self._place(x) for x in (toks, pos, tgt)))
            logp, greedy = (self._fetch(x) for x in scored)
            for r, i in enumerate(idx):
                n = requests[i][1]
                out[i] = (float(logp[r, :n].astype(np.float64).sum()), bool(greedy[r, :n].all()))
            b += len(idx)
            if progress is not None:
                progress(ScoreProgress(b, len(requests), time.perf_counter() - t0))
        return [x for x in out if x is not None]  # every request scored (one row each)
