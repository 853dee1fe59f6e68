"""Requests in, tokens out: a continuously batched decode over a paged KV cache.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
from jax.sharding import Mesh

from resformer_jax.engine.detokenizer import OutputText
from resformer_jax.engine.errors import EngineError
from resformer_jax.engine.pages import ShardedPages, pages_in_budget
from resformer_jax.engine.runner import DecodeRows, ModelRunner, ScoredRows, StepRows, free_memory_bytes
from resformer_jax.engine.sampling import TOP_LOGPROBS, SamplingParams, SamplingRows, bucket
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.transformer import cache_bytes_per_token
from resformer_jax.resolve import serving_model

# Decode steps one program runs between readbacks: the host's scheduling, dispatch and readback paid once for 8
# tokens a row (measured in docs/evaluation.md). While prompts are being read, one step a readback.
DECODE_STEPS = 8


FinishReason = Literal["stop", "length", "cancelled", "abort", "error"]  # abort: the server's; error: the engine's


@dataclasses.dataclass(frozen=True)
class NewToken:
    """A request's next token, as its on_output callback gets it: `text`, the text it adds that may be sent now
    (the engine detokenizes; "" without a tokenizer, or while a stop string could be forming), and `offset`, where
    the token's text begins in the request's; `shown` False for the stop id that ends a request (not in its text
    or token ids, as vLLM leaves it out, unless include_stop_str_in_output)."""

    token: int
    logprob: float
    text: str = ""
    offset: int = 0
    shown: bool = True


@dataclasses.dataclass(frozen=True)
class Finished:
    """A request's end, the last thing its on_output callback gets, with the text held back before it."""

    reason: FinishReason
    text: str = ""


Output = NewToken | Finished


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt and what has been generated for it; the engine's bookkeeping of where it is."""

    id: int
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    submitted_s: float = 0.0
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    on_output: Callable[[Request, Output], Any] | None = None  # streaming: each new token, then the end
    state: str = "waiting"  # waiting -> prefill -> decode -> done
    pages: list[int] = dataclasses.field(default_factory=list)  # numbered within its shard's pool
    shard: int = 0  # which shard of the cache (a device of the engine's mesh) holds its pages and runs its row
    cached: int = 0  # tokens whose K/V are in the cache
    preemptions: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)  # prefix-cache block ids of its first full pages
    scores: Scores | None = None  # asked by logprobs or prompt_logprobs: each position's log-probabilities
    carry: np.ndarray | None = None  # the hidden state before its first token to compute (a cached prefix's last)
    output: OutputText | None = None  # its text under its stop strings (an engine with a tokenizer's decode)
    shown: list[int] = dataclasses.field(default_factory=list)  # its tokens but a stop id that ended it

    @property
    def text(self) -> str:
        """The generated text, ended by a stop string where one was met ("" without a tokenizer)."""
        return self.output.text if self.output is not None else ""

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def to_cache(self) -> list[int]:
        """What the cache must hold before the next decode step: the prompt and every generated token but the
        last (the last is the next step's input)."""
        return self.prompt + self.tokens[:-1]

    @property
    def time_to_first_token_s(self) -> float | None:
        return self.token_times_s[0] - self.submitted_s if self.token_times_s else None

    @property
    def inter_token_s(self) -> list[float]:
        return list(np.diff(self.token_times_s))

    @property
    def time_per_output_token_s(self) -> float | None:
        """From the first token to the last, a token (vLLM's TPOT): k decode steps a readback hand a row its tokens
        k at a time, so most inter-token gaps are 0 and this is the pace a reader sees."""
        n = len(self.token_times_s)
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1) if n > 1 else None


class Scores:
    """Per position i of a request's prompt and generated tokens: log p(token_i | the tokens before it) and the
    TOP_LOGPROBS most likely tokens there with theirs, most likely first; None where not computed (position 0; the
    prompt when only generated tokens were asked)."""

    def __init__(self, prompt_len: int):
        self.logprob: list[float | None] = [None] * prompt_len
        self.top: list[tuple[np.ndarray, np.ndarray] | None] = [None] * prompt_len  # (ids, log-probabilities)
        self.page_ends: dict[int, np.ndarray] = {}  # page j -> the hidden state at its last position

    def set(self, i: int, logprob: float, ids: np.ndarray, lps: np.ndarray) -> None:
        while len(self.logprob) <= i:
            self.logprob.append(None)
            self.top.append(None)
        self.logprob[i], self.top[i] = float(logprob), (ids, lps)

    def entry(self, i: int) -> tuple[float, np.ndarray, np.ndarray] | None:
        top, lp = self.top[i], self.logprob[i]
        return None if top is None or lp is None else (lp, *top)

    def prompt_done(self, upto: int) -> bool:
        return all(self.top[i] is not None for i in range(1, upto))


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_readbacks: int = 0  # decode programs run, each read back once (decode_steps a program)
    generated_tokens: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    most_concurrent: int = 0  # requests holding cache pages at once
    most_pages_used: int = 0
    compiled_shapes: set = dataclasses.field(default_factory=set)  # (rows, tokens, pages) buckets compiled
    decode_seconds: float = 0.0
    decode_pages_read: int = 0  # pages the decode steps attended over, summed over steps (the filled ones)
    decode_rows: int = 0  # tokens the decode steps gave (kept: none after a stop)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache at admission (vLLM's prefix_cache_queries)
    prefix_hits: int = 0  # of those, tokens found cached: not prefilled, no new pages (vLLM's prefix_cache_hits)


class Engine:
    """The decode engine over one model's parameters (a run's, `load_run`), on this host's default device, or on
    every device of `mesh`: the rows and the cache's pages split over all its axes (each device runs its rows over
    its own pages, `shard_map`), the parameters replicated, or left as they come (sharded as in training: XLA
    gathers them into each step).

    cache_bytes: the paged cache's size a device (every layer together); cache_fraction instead: that fraction of
    the device's free memory (a CPU: of the host's available memory). detokenize: the tokenizer's decode (ids to
    text): each request's text is built as its tokens come, and its stop strings end it."""

    def __init__(
        self,
        m: ModelConfig,
        params,
        *,
        cache_bytes: float | None = None,
        cache_fraction: float | None = None,
        page_size: int = 16,
        max_batch: int = 64,
        prefill_chunk: int = 256,
        prefill_rows: int = 4,
        decode_steps: int = DECODE_STEPS,
        mesh: Mesh | None = None,
        prefix_cache: bool = True,
        detokenize: Callable[[list[int]], str] | None = None,
        stream: bool = False,
    ):
        self.model_cfg = serving_model(m)
        self.detokenize = detokenize
        self.page_size, self.max_batch = int(page_size), int(max_batch)
        self.prefill_chunk, self.prefill_rows = int(prefill_chunk), int(prefill_rows)
        self.decode_steps = int(decode_steps)
        self.prefix_cache = bool(prefix_cache)  # full pages of prompts kept and shared by their tokens (pages.py)
        self.stream = bool(stream)  # clients read tokens as sampled: decode_steps only when the load needs them
        sizes = (self.page_size, self.max_batch, self.prefill_chunk, self.prefill_rows, self.decode_steps)
        if min(sizes) < 1:
            raise EngineError("page_size, max_batch, prefill_chunk, prefill_rows and decode_steps must be >= 1")
        self.bytes_per_token = cache_bytes_per_token(self.model_cfg)
        self.mesh = mesh
        self.shards = 1 if mesh is None else int(mesh.devices.size)
        if cache_bytes is None:  # a share of the free memory, no more than a device's rows at full context take
            rows = -(-self.max_batch // self.shards)
            cache_bytes = min(
                free_memory_bytes() * (cache_fraction if cache_fraction is not None else 0.5),
                (rows * m.max_seq_len + self.page_size) * self.bytes_per_token,
            )
        num_pages = pages_in_budget(cache_bytes, self.bytes_per_token, self.page_size)
        if num_pages < 2:
            raise EngineError(
                f"a cache of {cache_bytes / 2**20:.2f} MiB holds less than one page of {self.page_size} tokens "
                f"({self.bytes_per_token * self.page_size / 2**20:.2f} MiB); raise the cache budget"
            )
        self.pool = ShardedPages(self.shards, num_pages, self.page_size)
        self.runner = ModelRunner(self.model_cfg, params, num_pages, self.page_size, mesh)
        self.max_len = m.max_seq_len
        self._next_id = 0
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admitted, in admission order (prefill or decode)
        self.stats = EngineStats()
        self.programs_at_start = 0  # the runner's programs compile_all ran

    # ------------------------------------------------------------------ requests
    def submit(
        self, prompt: Sequence[int], params: SamplingParams | None = None, on_output=None, request_id=None
    ) -> Request:
        """Queues a request (it joins the batch at the next step); EngineError names what cannot work."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        self.check(prompt, params)
        rid = request_id if request_id is not None else self._next_id
        self._next_id += 1
        r = Request(rid, prompt, params, submitted_s=time.perf_counter(), on_output=on_output)
        if self.detokenize is not None:
            r.output = OutputText(self.detokenize, params.stop, params.include_stop_str_in_output)
        self.waiting.append(r)
        return r

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """EngineError if the request cannot run here (reads only what never changes: safe from any thread)."""
        m = self.model_cfg
        params.check(m.vocab_size)
        if params.stop and self.detokenize is None:
            raise EngineError("stop strings need the text: this engine has no tokenizer (Engine(detokenize=...))")
        if not prompt:
            raise EngineError("the prompt is empty; give at least one token")
        if any(t < 0 or t >= m.vocab_size for t in prompt):
            raise EngineError(f"the prompt holds token ids outside the vocabulary [0, {m.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_len:
            raise EngineError(
                f"the prompt ({len(prompt)} tokens) and max_tokens ({params.max_tokens}) exceed the model's context "
                f"of {self.max_len} tokens; shorten the prompt or lower max_tokens"
            )
        need = self.pool.pages_for(len(prompt) + params.max_tokens)
        if need > self.pool[0].usable:
            raise EngineError(
                f"one sequence of {len(prompt) + params.max_tokens} tokens needs {need} pages of the cache's "
                f"{self.pool[0].usable} a device ({self.cache_bytes / self.shards / 2**20:.1f} MiB); raise the cache "
                "budget or lower max_tokens"
            )

    def cancel(self, r: Request, reason: FinishReason = "cancelled") -> None:
        """Ends a request now (a client that went away; a stop string: reason 'stop'): its pages go back to the
        pool at once."""
        if r.done:
            return
        if r in self.waiting:
            self.waiting.remove(r)
        self._finish(r, reason)

    @property
    def cache_bytes(self) -> int:
        return self.runner.cache_bytes

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]):
        """Every prompt to completion (all queued at once, batched by the scheduler); the requests in order."""
        many = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = [self.submit(p, s) for p, s in zip(prompts, many)]
        while self.busy:
            self.step()
        return reqs

    def skip_prefill(self) -> None:
        """Benchmarks: admits every waiting request and counts its prompt as cached without computing it (its pages
        taken, holding whatever they held): the next steps decode, at the bytes the real prompts would cost."""
        self._admit(share=False)  # the prompts are not computed: nothing to share or wait for
        for r in self.running:
            if r.state == "prefill":
                if not self._grow(r, len(r.to_cache) + 1):
                    raise EngineError("skip_prefill: the pool cannot hold every admitted prompt")
                r.cached, r.state = len(r.to_cache), "decode"
                r.tokens.append(r.prompt[-1])  # a stand-in first token: the next step's input

    # ------------------------------------------------------------------ compiles
    def program_shapes(self) -> list[tuple[int, int, int, int]]:
        """Every (rows, tokens, pages, k) `_run` can lay out: prefill chunks (tokens 16, 64, ... up to the chunk's
        bucket), single decode steps (1 token, k = 1) and k-step decodes (k = 2, 4, ... up to decode_steps' bucket),
        at every row bucket up to max_batch (prefill: prefill_rows) and every page bucket up to a full context."""
        per_shard = -(-self.max_batch // self.shards)
        min_rows = self.runner.form.min_rows

        def buckets(n: int, at_least: int = 1, base: int = 2) -> list[int]:
            return sorted({bucket(i, at_least, base) for i in range(1, n + 1)})

        chunk = bucket(self.prefill_chunk)
        prefill_T = sorted({min(T, chunk) for T in buckets(self.prefill_chunk, 16, 4)})
        ks = [1] + [k for k in buckets(self.decode_steps) if k > 1]
        shapes = []
        for Pn in buckets(self._most_pages(), 4):
            for Bs in buckets(min(self.prefill_rows, per_shard), min_rows):
                shapes += [(self.shards * Bs, T, Pn, 1) for T in prefill_T]
            if Pn == self._decode_pages(Pn):  # one-token steps at this table width
                for Bs in buckets(per_shard, min_rows):
                    shapes += [(self.shards * Bs, 1, Pn, k) for k in ks]
        return shapes

    def _most_pages(self) -> int:
        """The most pages a row holds: a full context's, or the pool's."""
        return min(self.pool.pages_for(self.max_len), self.pool[0].usable)

    def _decode_pages(self, Pn: int) -> int:
        """The page-table width a one-token step of rows holding at most `Pn` pages (a bucket) runs at: that, or
        where the step form says its cost does not grow with the width, the widest (one program for every Pn)."""
        return max(Pn, bucket(self._most_pages(), at_least=4)) if self.runner.form.decode_table_full else Pn

    def compile_all(self, log: Callable[[str], Any] | None = None) -> float:
        """Compiles and runs once, on padding rows, every program `program_shapes` lists for requests without
        logprobs, penalties or token masks, so serving them compiles nothing and meets no program's costlier first
        run (the others compile their variant when first met: `compiles_after_start` counts them). Returns the
        seconds it took. One at a time: XLA:CPU's compile of one program already keeps both cores of a 2-core host
        busy (threads measured no faster)."""
        t0 = last = time.perf_counter()
        shapes = self.program_shapes()
        for n, (B, T, Pn, k) in enumerate(shapes, 1):
            table, zeros = np.zeros((B, Pn), np.int32), np.zeros((B,), np.int32)
            if k == 1:
                rows: StepRows | DecodeRows = StepRows(
                    np.zeros((B, T), np.int32), np.full((B, T), -1, np.int32), table, zeros
                )
            else:
                rows = DecodeRows(zeros, np.full((B,), -1, np.int32), table, zeros)
            self.runner.warm(rows, SamplingRows.of(B, []), k)
            if log is not None and (time.perf_counter() - last > 10 or n == len(shapes)):
                last = time.perf_counter()
                log(f"compiled {n}/{len(shapes)} programs, {last - t0:.0f} s")
        self.programs_at_start = len(self.runner.programs)
        return time.perf_counter() - t0

    @property
    def compiles_after_start(self) -> int:
        """Programs first run after compile_all (all of them without it): each a compile while serving."""
        return len(self.runner.programs) - self.programs_at_start

    # ------------------------------------------------------------------ the scheduler
    def step(self) -> list[Request]:
        """One turn: admit, one prefill step, one decode step. Returns the requests that finished in it."""
        finished: list[Request] = []
        self._admit()
        prefill = [r for r in self.running if r.state == "prefill"][: self.prefill_rows]
        if prefill:
            finished += self._prefill(prefill)
        decode = [r for r in self.running if r.state == "decode"]
        if decode:
            k = self.steps_a_readback()
            decode = self._reserve_decode_pages(decode, k)
            if decode:
                finished += self._decode(decode, k)
        self.stats.steps += 1
        return finished

    def steps_a_readback(self) -> int:
        """The decode steps this turn runs between readbacks: decode_steps, but one while a prompt is being read
        (its chunks interleave per token) and, when streaming, one while rows are free and nobody waits: below
        that load each token reaches its client as sampled; at it, k steps a readback buy throughput."""
        if any(r.state == "prefill" for r in self.running):
            return 1
        if self.stream and len(self.running) < self.max_batch and not self.waiting:
            return 1
        return self.decode_steps

    def _admit(self, share: bool = True) -> None:
        # a shard's pages the requests still reading their prompts will take: promised, not yet handed out
        promised = [0] * self.shards
        rows = [0] * self.shards
        for r in self.running:
            rows[r.shard] += 1
            if r.state == "prefill":
                promised[r.shard] += max(0, self.pool.pages_for(len(r.to_cache) + 1) - len(r.pages))
        rows_per_shard = -(-self.max_batch // self.shards)
        deferred: list[Request] = []  # waiting for a prefix another request is computing now
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting[0]
            if share and self._prefix_in_flight(r):
                deferred.append(self.waiting.popleft())
                continue
            tokens = r.to_cache
            need = self.pool.pages_for(len(tokens) + 1)
            best = None  # (cached pages, room to spare, shard, pages, blocks): the longest prefix found, then room
            for sh in range(self.shards):
                if rows[sh] >= rows_per_shard:
                    continue
                pool = self.pool[sh]
                # the last token is always computed (its logits give the next), so a page holding it is never shared
                most = (len(tokens) - 1) // self.page_size if self.prefix_cache and share else 0
                pages, blocks = pool.match(tokens, most, scored=r.params.prompt_logprobs is not None)
                idle = sum(1 for p in pages if pool.holders[p] == 0)  # leaving the free count when shared
                spare = pool.free - promised[sh] - idle - (need - len(pages))
                if spare >= 0 and (best is None or (len(pages), spare) > best[:2]):
                    best = (len(pages), spare, sh, pages, blocks)
            if best is None:
                break  # the oldest waits for pages (first come, first served)
            _, _, shard, pages, blocks = best
            self.waiting.popleft()
            self.pool[shard].share(pages)
            r.state, r.shard, r.pages, r.blocks = "prefill", shard, list(pages), list(blocks)
            r.cached = len(pages) * self.page_size
            if r.scores is None and (r.params.logprobs is not None or r.params.prompt_logprobs is not None):
                r.scores = Scores(len(r.prompt))
            if r.params.prompt_logprobs is not None:  # the cached pages' prompt scores, kept with their blocks
                for j, block in enumerate(blocks):
                    for i, entry in enumerate(self.pool[shard].scores_of(block)):
                        if entry is not None and j * self.page_size + i < len(r.prompt):
                            r.scores.set(j * self.page_size + i, *entry)  # type: ignore[union-attr]
                if blocks:  # the next token's log-probability reads the cached prefix's last hidden state
                    r.carry = self.pool[shard].hidden_of(blocks[-1])
            if self.prefix_cache:
                self.stats.prefix_queries += len(tokens)
                self.stats.prefix_hits += r.cached
            self.running.append(r)
            promised[shard] += need - len(pages)
            rows[shard] += 1
        self.waiting.extendleft(reversed(deferred))  # first in line again, in their order

    def _prefix_in_flight(self, r: Request) -> bool:
        """Whether a request still reading its prompt shares full pages with `r` that it has not cached yet: `r`
        waits for them (a step or a few) instead of computing and holding the same prefix a second time."""
        if not self.prefix_cache:
            return False
        tokens, ps = r.to_cache, self.page_size
        for other in self.running:
            if other.state != "prefill":
                continue
            theirs = other.to_cache
            common = 0
            limit = min(len(tokens) - 1, len(theirs)) // ps
            while common < limit and tokens[common * ps : (common + 1) * ps] == theirs[common * ps : (common + 1) * ps]:
                common += 1
            if common > len(other.blocks):
                return True
        return False

    def _register_full_pages(self, r: Request) -> None:
        """The pages `r` has filled completely since it was admitted become prefix-cache blocks (after the step that
        wrote them: a page still being filled, or a request cancelled mid-prefill, leaves nothing half-written
        cached)."""
        if not self.prefix_cache:
            return
        pool, tokens = self.pool[r.shard], r.to_cache
        for j in range(len(r.blocks), min(r.cached, len(tokens)) // self.page_size):
            if r.blocks and r.blocks[-1] < 0:
                return  # the chain is broken (an equal page was another block's): nothing after it is findable
            parent = r.blocks[-1] if r.blocks else -1
            ps = self.page_size
            block = pool.register(r.pages[j], parent, tokens[j * ps : (j + 1) * ps])
            r.blocks.append(block)
            s = r.scores
            if s is None or block < 0 or (j + 1) * ps > len(r.prompt):
                continue
            if s.prompt_done((j + 1) * ps) and j in s.page_ends:
                pool.keep_scores(block, [s.entry(i) for i in range(j * ps, (j + 1) * ps)], s.page_ends[j])

    def _grow(self, r: Request, tokens: int) -> bool:
        """Pages for `r` to hold `tokens` tokens; False when the pool has too few."""
        need = self.pool.pages_for(tokens) - len(r.pages)
        if need <= 0:
            return True
        if need > self.pool[r.shard].free:
            return False
        r.pages += self.pool[r.shard].take(need)
        self.stats.most_pages_used = max(self.stats.most_pages_used, self.pool.used)
        return True

    def _preempt_newest(self, keep: Request) -> Request | None:
        """Frees the pages of the most recently admitted request other than `keep` in `keep`'s shard: it waits
        again, first in line, and is recomputed (its generated tokens kept)."""
        for victim in reversed(self.running):
            if victim is not keep and victim.pages and victim.shard == keep.shard:
                self.running.remove(victim)
                self.pool[victim.shard].give_back(victim.pages)
                victim.pages, victim.cached, victim.state, victim.blocks = [], 0, "waiting", []
                victim.preemptions += 1
                self.stats.preemptions += 1
                self.waiting.appendleft(victim)
                return victim
        return None

    def _steps_left(self, r: Request, k: int) -> int:
        """Decode steps row r takes of the next k: up to its max tokens or the model's context (at least 1)."""
        return min(k, r.params.max_tokens - len(r.tokens), self.max_len - len(r.prompt) - len(r.tokens))

    def _reserve_decode_pages(self, rows: list[Request], k: int) -> list[Request]:
        out = []
        for r in rows:  # oldest first: the newest are preempted for them
            while r.state == "decode" and not self._grow(r, r.cached + self._steps_left(r, k)):
                if self._preempt_newest(keep=r) is None:
                    raise RuntimeError("no page for the only running request")  # submit() rules this out
            out.append(r)
        return [r for r in out if r.state == "decode"]  # a later row may have preempted an earlier one

    # ------------------------------------------------------------------ steps
    def _prefill(self, rows: list[Request]) -> list[Request]:
        chunks = []
        for r in rows:
            todo = r.to_cache[r.cached : r.cached + self.prefill_chunk]
            while r.state == "prefill" and not self._grow(r, r.cached + len(todo)):
                if self._preempt_newest(keep=r) is None:
                    raise RuntimeError("no page for the only running request")  # submit() rules this out
            chunks.append(todo)
        live = [(r, c) for r, c in zip(rows, chunks) if r.state == "prefill"]
        if not live:
            return []
        # prompt tokens a row: 16, 64, 256, ... (at most the chunk): few compiles, little padding
        T = min(bucket(max(len(c) for _, c in live), at_least=16, base=4), bucket(self.prefill_chunk))
        scored = any(r.scores is not None for r, _ in live)
        tok, lp, scores = self._run([r for r, _ in live], [c for _, c in live], T, top=TOP_LOGPROBS if scored else 0)
        self.stats.prefill_steps += 1
        finished = []
        for i, (r, c) in enumerate(live):
            if r.scores is not None:  # score j: token cached + j (0: from the carried state; the last: the next)
                chosen, ids, lps, hidden = (x[i] for x in scores)  # type: ignore[index]
                for j in range(0 if r.carry is not None else 1, len(c) + 1):
                    at = r.cached + j
                    if at < len(r.prompt) and r.params.prompt_logprobs is not None:
                        r.scores.set(at, chosen[j], ids[j], lps[j])
                    elif at == len(r.prompt) and not r.tokens:
                        r.scores.set(at, 0.0, ids[j], lps[j])  # its log-probability comes with the token
                for j in range(len(c)):  # a page's last hidden state, kept with its block
                    if (r.cached + j + 1) % self.page_size == 0:
                        r.scores.page_ends[(r.cached + j) // self.page_size] = hidden[j]
                r.carry = None
            r.cached += len(c)
            self.stats.prefill_tokens += len(c)
            self._register_full_pages(r)
            if r.cached == len(r.to_cache):
                r.state = "decode"
                if r.params.max_tokens == 0:  # the prompt scored: nothing to generate
                    self._finish(r, "length")
                    finished.append(r)
                # the prompt's last token gives the first new one (after a preemption it is known already)
                elif not r.tokens and self._emit(r, int(tok[i, 0]), float(lp[i, 0])):
                    finished.append(r)
        return finished

    def _decode(self, rows: list[Request], k: int) -> list[Request]:
        t0 = time.perf_counter()
        steps = [self._steps_left(r, k) for r in rows]
        k = bucket(max(steps))  # no more steps than the rows need (1, 2, 4 or 8: few compiles)
        top = TOP_LOGPROBS if any(r.params.logprobs is not None for r in rows) else 0
        tok, lp, tops = self._run(rows, [[r.tokens[-1]] for r in rows], 1, steps if k > 1 else None, k, top)
        if top and k == 1:  # the step program's scores: at 1 the token fed's next (0: the carried state's)
            tops = (tops[1][:, 1:2], tops[2][:, 1:2])
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_steps += k
        self.stats.decode_readbacks += 1
        self.stats.decode_pages_read += sum(
            self.pool.pages_for(r.cached + 1 + i) for r, n in zip(rows, steps) for i in range(n)
        )
        finished = []
        for i, (r, n) in enumerate(zip(rows, steps)):
            for j in range(n):  # tokens after a stop id were computed and are dropped
                r.cached += 1
                self.stats.decode_rows += 1
                if top and r.scores is not None:
                    r.scores.set(len(r.prompt) + len(r.tokens), 0.0, tops[0][i, j], tops[1][i, j])
                if self._emit(r, int(tok[i, j]), float(lp[i, j])):
                    finished.append(r)
                    break
        return finished

    def _run(
        self,
        rows: list[Request],
        new_tokens: list[list[int]],
        T: int,
        steps: list[int] | None = None,
        k: int = 1,
        top: int = 0,
    ):
        """One step: row i's `new_tokens[i]` at positions from rows[i].cached on; with `steps`, decode_program's
        k steps from row i's one token, steps[i] of them written. Rows are laid out shard by shard (each shard's
        slots padded to one bucket; position -1: a padding slot). Returns (token, logprob) a row, [rows, k] each,
        and with `top` the scores: a step (chosen [rows, T], top ids and log-probabilities [rows, T, top]): each
        position's log-probability of the token after it and the `top` most likely there; decode k steps (top
        ids and log-probabilities [rows, k, top]); None without."""
        holding = sum(1 for r in self.running if r.pages)  # the pages of this step are allocated by now
        self.stats.most_concurrent = max(self.stats.most_concurrent, holding)
        per_shard = [0] * self.shards
        slot = []
        for r in rows:
            slot.append(per_shard[r.shard])
            per_shard[r.shard] += 1
        Bs = bucket(max(per_shard), at_least=self.runner.form.min_rows)  # rows a shard
        slot = [r.shard * Bs + j for r, j in zip(rows, slot)]
        B = self.shards * Bs
        Pn = bucket(max(len(r.pages) for r in rows), at_least=4)
        Pn = self._decode_pages(Pn) if T == 1 else Pn
        tokens, positions = np.zeros((B, T), np.int32), np.full((B, T), -1, np.int32)
        last, table = np.zeros((B,), np.int32), np.zeros((B, Pn), np.int32)
        for i, r, new in zip(slot, rows, new_tokens):
            tokens[i, : len(new)] = new
            positions[i, : len(new)] = np.arange(r.cached, r.cached + len(new))
            last[i] = len(new) - 1
            table[i, : len(r.pages)] = r.pages
        sampling = SamplingRows.of(B, [(i, r.params, r.prompt, r.tokens) for i, r in zip(slot, rows)])
        if steps is None:
            self.stats.compiled_shapes.add((B, T, Pn, 1))
            scored = None
            if top:  # the token after each one fed: the next of the sequence (0 past its end: not read)
                scored = ScoredRows(np.zeros((B, T), np.int32), np.zeros((B, self.model_cfg.d_model), np.float32))
                for i, r, new in zip(slot, rows, new_tokens):
                    after = r.to_cache[r.cached + 1 : r.cached + len(new) + 1]
                    scored.targets_BxT[i, : len(after)] = after
                    if r.carry is not None:
                        scored.carry_BxE[i] = r.carry
            out = self.runner.step(top, StepRows(tokens, positions, table, last), sampling, scored)
            tok, lp = out[0], out[1]
            scores = tuple(np.asarray(x)[slot] for x in out[2]) if top else None
            return np.asarray(tok)[slot][:, None], np.asarray(lp)[slot][:, None], scores
        steps_B = np.zeros((B,), np.int32)
        steps_B[slot] = steps
        self.stats.compiled_shapes.add((B, T, Pn, k))
        out = self.runner.decode(k, top, DecodeRows(tokens[:, 0], positions[:, 0], table, steps_B), sampling)
        tok, lp = out[0], out[1]
        tops = tuple(np.asarray(x)[slot] for x in out[2][1:]) if top else None  # (ids, log-probabilities)
        return np.asarray(tok)[slot], np.asarray(lp)[slot], tops

    # ------------------------------------------------------------------ ends
    def _emit(self, r: Request, token: int, logprob: float) -> bool:
        """Records a new token; True if it ended the request."""
        r.tokens.append(token)
        r.logprobs.append(logprob)
        at = len(r.prompt) + len(r.tokens) - 1
        top = r.scores.top[at] if r.scores is not None and at < len(r.scores.top) else None
        if r.scores is not None and top is not None:  # the step's top tokens are set already; the chosen one's here
            among = np.flatnonzero(top[0] == token)
            # read off the same log-softmax as its alternatives where it is one (the sampler's own differs by
            # round-off), so a token's log-probability equals its entry in top_logprobs, as vLLM's does
            r.scores.logprob[at] = float(top[1][among[0]]) if among.size else logprob
        r.token_times_s.append(time.perf_counter())
        self.stats.generated_tokens += 1
        p, stopping = r.params, len(r.tokens) >= r.params.min_tokens
        stop_id = token in p.stop_ids and stopping
        shown = not stop_id or p.include_stop_str_in_output
        stop_text, text, offset = False, "", 0
        if shown:
            r.shown.append(token)
            if r.output is not None:
                stop_text = r.output.add(token, stopping)
                text, offset = r.output.delta(), r.output.offset
        if r.on_output is not None:
            r.on_output(r, NewToken(token, logprob, text, offset, shown))
            if r.done:  # the callback ended it (a client gone)
                return True
        if stop_id or stop_text:
            self._finish(r, "stop")
        elif len(r.tokens) >= p.max_tokens or len(r.prompt) + len(r.tokens) >= self.max_len:
            self._finish(r, "length")
        return r.done

    def _finish(self, r: Request, reason: FinishReason) -> None:
        if r in self.running:
            self.running.remove(r)
        self.pool[r.shard].give_back(r.pages)
        r.pages, r.state, r.finish_reason, r.blocks = [], "done", reason, []
        if r.on_output is not None:
            r.on_output(r, Finished(reason, r.output.delta(final=True) if r.output is not None else ""))
