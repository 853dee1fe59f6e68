"""Grain input pipelines over prepared ArrayRecord corpora, tfds, or synthetic data.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import functools

import grain
import numpy as np

from resformer_jax.config import PAPER_MIXTURE, parse_mixture
from resformer_jax.data.records import DataError, DomainSource, check_compatible, corpus_path, load_metadata
from resformer_jax.data.tfds_source import tfds_domain_source


def domain_weights(meta: dict, split: str, mixture: dict | None) -> dict[str, float]:
    present = {d for d, st in meta["splits"].get(split, {}).items() if st.get("sequences", 0) > 0}
    if not present:
        raise DataError(f"prepared data has no sequences in split {split!r}; prepare more text or a smaller seq_len")
    if mixture:
        missing = [d for d, w in mixture.items() if w > 0 and d not in present]
        if missing:
            raise DataError(
                f"config.data.mixture asks for {missing} but split {split!r} has shards only for "
                f"{sorted(present)}; fix the mixture or prepare those domains"
            )
        weights = {d: float(w) for d, w in mixture.items() if w > 0}
    else:
        weights = {d: PAPER_MIXTURE.get(d, 0.0) for d in present}
        if sum(weights.values()) == 0:  # no SlimPajama domain names: equal weights
            weights = {d: 1.0 for d in present}
        weights = {d: w for d, w in weights.items() if w > 0}
    total = sum(weights.values())
    return {d: w / total for d, w in sorted(weights.items())}


# ----------------------------------------------------------------------------- sources


class Mixture:
    """Deterministic weighted mixture: global index g -> (domain, record), O(1) per lookup.

    Indices come in blocks of `block`; each block holds round(w_d * block)
    items of domain d (largest remainders) in an order shuffled by (seed,
    block). Within a domain, items are numbered consecutively across blocks and
    mapped to records by a fresh permutation per epoch (grain's index_shuffle).
    """

    def __init__(self, sizes: list[int], weights: list[float], seed: int, block: int = 4096):
        w = np.asarray(weights, np.float64)
        raw = w / w.sum() * block
        counts = np.floor(raw).astype(np.int64)
        for i in np.argsort(-(raw - counts))[: block - counts.sum()]:
            counts[i] += 1
        self.sizes, self.counts, self.seed, self.block = sizes, counts, seed, block
        self.assign = np.repeat(np.arange(len(sizes)), counts)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - bounded; a mixture lives as long as its loader
    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(domain of each position, its rank among that domain's items in the block)."""
        dom = self.assign[np.random.default_rng([self.seed, b]).permutation(self.block)]
        rank = np.empty(self.block, np.int64)
        for d in range(len(self.sizes)):
            where = np.nonzero(dom == d)[0]
            rank[where] = np.arange(len(where))
        return dom, rank

    def __call__(self, g: int) -> tuple[int, int]:
        b, r = divmod(int(g), self.block)
        dom, rank = self._block(b)
        d = int(dom[r])
        j = b * int(self.counts[d]) + int(rank[r])  # this domain's j-th item overall
        epoch, i = divmod(j, self.sizes[d])
        rec = grain.experimental.index_shuffle(
            i, max_index=self.sizes[d] - 1, seed=(self.seed * 1_000_003 + epoch * 7919 + d) % (2**31), rounds=4
        )
        return d, int(rec)


class SyntheticSource:
    """Learnable synthetic sequences: x_t = (a + s*t) mod V with (a, s) drawn from (seed, g)."""

    def __init__(self, vocab_size: int, record_len: int, seed: int):
        self.vocab_size, self.record_len, self.seed = vocab_size, record_len, seed

    def __call__(self, g: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(g)])
        a, s = rng.integers(self.vocab_size), rng.integers(1, 8)
        return ((a + s * np.arange(self.record_len)) % self.vocab_size).astype(np.int32)


# ----------------------------------------------------------------------------- batches


class BatchReader:
    """step -> this process's slice of the global batch, [local_batch, seq_len + 1] int32."""

    def __init__(self, read_global, global_batch: int, process_index: int, process_count: int):
        if global_batch % process_count:
            raise DataError(
                f"config.train.global_batch={global_batch} does not divide over {process_count} "
                "processes; choose a multiple of the process count"
            )
        self.read_global, self.gb = read_global, global_batch
        self.local = global_batch // process_count
        self.first = process_index * self.local

    def __call__(self, step: int) -> np.ndarray:
        base = int(step) * self.gb + self.first
        return np.stack([self.read_global(base + i) for i in range(self.local)])


class CorpusReader:
    def __init__(self, sources: list[DomainSource], mixture: Mixture):
        self.sources, self.mixture = sources, mixture

    def __call__(self, g: int) -> np.ndarray:
        d, rec = self.mixture(g)
        return self.sources[d][rec]


def train_reader(cfg, meta: dict | None = None):
    """A pure function g -> sequence for the training split, and the domain names."""
    d = cfg.data
    record_len = d.seq_len + 1
    if d.source == "synthetic":
        return SyntheticSource(cfg.model.vocab_size, record_len, d.seed), ["synthetic"]
    path = corpus_path(cfg.data)
    meta = meta or load_metadata(path)
    check_compatible(meta, d.seq_len, cfg.model.vocab_size, d.tokenizer_hash, path)
    weights = domain_weights(meta, "train", parse_mixture(d.mixture) or None)
    sources = [open_domain(cfg, path, meta, "train", dom) for dom in weights]
    return CorpusReader(sources, Mixture([len(s) for s in sources], list(weights.values()), d.seed)), list(weights)


def open_domain(cfg, path, meta, split, domain):
    if cfg.data.source == "tfds":
        return tfds_domain_source(path, split, domain)
    return DomainSource(path, meta, split, domain)


def train_iterator(cfg, process_index: int = 0, process_count: int = 1):
    """A checkpointable grain iterator over this process's batches, reading ahead in threads."""
    read_global, _ = train_reader(cfg)
    reader = BatchReader(read_global, cfg.train.global_batch, process_index, process_count)
    ds = grain.MapDataset.range(0, 1 << 40).map(reader)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.data.num_threads, prefetch_buffer_size=cfg.data.prefetch))
    return iter(it)


def validation_sets(
    cfg, batch: int, num_batches: int, process_index: int = 0, process_count: int = 1, all_records: bool = False
) -> dict[str, list[np.ndarray]]:
    """Per-domain validation batches (this process's slice), read in record order.

    With all_records=True (one process) every record of the split once, the last batch of a domain holding what
    is left (the paper's Table 5 evaluation); otherwise the first num_batches whole batches.
    """
    d = cfg.data
    if d.source == "synthetic":
        src = SyntheticSource(cfg.model.vocab_size, d.seq_len + 1, d.seed + 10_000)
        reader = BatchReader(src, batch, process_index, process_count)
        # synthetic data has no "whole split": all_records reads the run's eval_batches (an empty set gave NaN)
        n = max(num_batches, cfg.train.eval_batches, 1) if all_records else num_batches
        return {"synthetic": [reader(i) for i in range(n)]}
    path = corpus_path(cfg.data)
    meta = load_metadata(path)
    check_compatible(meta, d.seq_len, cfg.model.vocab_size, "", path)
    out = {}
    for dom, st in sorted(meta["splits"].get("validation", {}).items()):
        if not st.get("sequences"):
            continue
        src = open_domain(cfg, path, meta, "validation", dom)
        if all_records:
            out[dom] = [
                np.stack([src[g] for g in range(i, min(i + batch, len(src)))]) for i in range(0, len(src), batch)
            ]
            continue
        n_batches = min(num_batches, len(src) // batch)
        if n_batches == 0:  # fewer records than a batch: wrap around so the domain is still measured
            n_batches = 1
        reader = BatchReader(lambda g, src=src: src[g % len(src)], batch, process_index, process_count)
        out[dom] = [reader(i) for i in range(n_batches)]
    return out
