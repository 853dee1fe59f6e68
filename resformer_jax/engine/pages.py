"""The page pool: which pages of the paged cache are free, and how many pages a memory budget buys."""

from __future__ import annotations

import collections
import math

from resformer_jax.engine.errors import EngineError


class PagePool:
    """Pages 1..num_pages-1 of the cache, handed to sequences and returned the moment they end. Page 0 is never
    handed out: padding tokens write there (model/attention.PageLayout).

    With the prefix cache (vLLM's automatic prefix caching): a full page of a sequence's tokens is registered as a
    block, keyed by its tokens and the block before it, so the same tokens after the same prefix find it. A page
    may be held by several sequences (counted); when the last lets it go it stays cached, idle, until the pool needs
    a page and none is free: then the least recently used idle page is evicted. A held page is never evicted. One
    page id indexes every layer's pool, so a block is a layer's K and V alike (SVFormer: every layer's K and the one
    V_1 chain together)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise EngineError(f"a paged cache needs at least 2 pages (1 usable), got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out the lowest first
        self.holders = [0] * num_pages  # sequences holding each page
        self._blocks: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent block, tokens) -> block id
        self._page_of: dict[int, int] = {}  # block id -> page
        self._block_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # page -> its block's key
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unheld; LRU first
        self._scores: dict[int, tuple] = {}  # block id -> (its tokens' prompt scores, its last hidden state)
        self._next_block = 0

    @property
    def usable(self) -> int:
        return self.num_pages - 1

    @property
    def free(self) -> int:
        """Pages a sequence can take: never handed out, or cached and held by no one (evicted when taken)."""
        return len(self._free) + len(self._idle)

    @property
    def used(self) -> int:
        return self.usable - self.free

    @property
    def cached(self) -> int:
        """Pages registered as blocks (held or idle)."""
        return len(self._block_of)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def take(self, n: int) -> list[int]:
        if n > self.free:
            raise RuntimeError(f"asked {n} pages with {self.free} free")  # the scheduler checks first
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:  # the least recently used cached page no sequence holds
                page, _ = self._idle.popitem(last=False)
                self._forget(page)
            self.holders[page] = 1
            out.append(page)
        return out

    def give_back(self, pages: list[int]) -> None:
        for page in reversed(pages):
            self.holders[page] -= 1
            if self.holders[page] > 0:
                continue
            if page in self._block_of:
                self._idle[page] = None  # most recently used last
            else:
                self._free.append(page)

    # ---------------------------------------------------------------------------------------- the prefix cache
    def match(self, tokens: list[int], most: int, scored: bool = False) -> tuple[list[int], list[int]]:
        """(pages, block ids) of the longest run of cached blocks that starts `tokens`, at most `most` pages;
        `scored`: of blocks that keep their tokens' prompt scores (a request that asks for them)."""
        pages, blocks, parent = [], [], -1
        for j in range(min(most, len(tokens) // self.page_size)):
            block = self._blocks.get((parent, tuple(tokens[j * self.page_size : (j + 1) * self.page_size])))
            if block is None or (scored and block not in self._scores):
                break
            pages.append(self._page_of[block])
            blocks.append(block)
            parent = block
        return pages, blocks

    def share(self, pages: list[int]) -> None:
        """A sequence holds these cached pages too (found by `match`)."""
        for page in pages:
            self._idle.pop(page, None)
            self.holders[page] += 1

    def register(self, page: int, parent: int, tokens: list[int]) -> int:
        """`page`, full of `tokens` after block `parent` (-1: the first), becomes a block; returns its id (an equal
        block cached already keeps its page, and its id is returned: the later copy stays the sequence's own)."""
        key = (parent, tuple(tokens))
        block = self._blocks.get(key)
        if block is None and page not in self._block_of:
            block, self._next_block = self._next_block, self._next_block + 1
            self._blocks[key], self._page_of[block], self._block_of[page] = block, page, key
        return block if block is not None else -2  # -2: the page is another block's; nothing chains after it

    def keep_scores(self, block: int, entries: list, last_hidden) -> None:
        """A block's tokens' prompt scores (per token: log-probability, top ids, their log-probabilities; None at
        a sequence's first) and the hidden state at its last token (the next token's log-probability reads it),
        kept with it: a function of the block's tokens and those before it, as its K/V are."""
        self._scores.setdefault(block, (entries, last_hidden))

    def scores_of(self, block: int) -> list:
        return self._scores[block][0] if block in self._scores else []

    def hidden_of(self, block: int):
        return self._scores[block][1]

    def _forget(self, page: int) -> None:
        key = self._block_of.pop(page)
        block = self._blocks.pop(key)
        self._page_of.pop(block)
        self._scores.pop(block, None)


class ShardedPages:
    """One PagePool a shard of the cache (a device of the engine's mesh; one without a mesh): a sequence's pages all
    come from its shard's pool, numbered within it. Totals over the shards for the metrics."""

    def __init__(self, shards: int, pages_per_shard: int, page_size: int):
        self.shards = [PagePool(pages_per_shard, page_size) for _ in range(shards)]
        self.page_size = page_size

    def __getitem__(self, shard: int) -> PagePool:
        return self.shards[shard]

    @property
    def usable(self) -> int:
        return sum(p.usable for p in self.shards)

    @property
    def free(self) -> int:
        return sum(p.free for p in self.shards)

    @property
    def used(self) -> int:
        return sum(p.used for p in self.shards)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)


def pages_in_budget(budget_bytes: float, bytes_per_token: int, page_size: int) -> int:
    """Pages (page 0 included) a cache of `budget_bytes` holds, at `bytes_per_token` summed over layers."""
    return int(budget_bytes // (bytes_per_token * page_size))
