"""The page pool: which pages of the paged cache are free, and how many pages a memory budget buys."""

from __future__ import annotations

import math

from resformer_jax.errors import UserError


class EngineError(UserError):
    """A request or an engine setting that cannot work; the message says what to change."""


class PagePool:
    """Pages 1..num_pages-1 of the cache, handed to sequences and returned the moment they end. Page 0 is never
    handed out: padding tokens write there (model/attention.PageLayout)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise EngineError(f"a paged cache needs at least 2 pages (1 usable), got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out the lowest first

    @property
    def usable(self) -> int:
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.usable - self.free

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked {n} pages with {len(self._free)} free")  # the scheduler checks first
        return [self._free.pop() for _ in range(n)]

    def give_back(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


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
