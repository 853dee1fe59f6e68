"""A prepared corpus on disk: metadata.json, the tokenizer, and its ArrayRecord shards.

`data_prep.prepare` writes the folder; training reads it through `open_corpus`
(which also resolves the demo corpus), `DomainSource` (one split and domain),
and copies and checks the tokenizer with `Corpus`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import grain
import numpy as np
from etils import epath

from resformer_jax.errors import UserError, one_line


class DataError(UserError):
    """Bad data or data config; the message names the cause and the fix."""


# ----------------------------------------------------------------------------- metadata


META_KEYS = ("format", "tokenizer", "seq_len", "record_len", "dtype", "splits")


def load_metadata(path: str) -> dict:
    if not path:
        raise DataError("config.data.path is empty; point it at a folder written by `python -m data_prep.prepare`")
    if "://" in path:
        raise DataError(
            f"data path {path!r} is on object storage, which ArrayRecord cannot read (grain's ArrayRecordDataSource "
            "opens shards with the local file API). Copy the corpus to local disk (gcloud storage cp -r "
            f"{path} /data/corpus, or aws s3 cp --recursive) or mount the bucket (gcsfuse, mountpoint-s3) and set "
            "config.data.path to the local folder"
        )
    if not os.path.isdir(path):
        raise DataError(
            f"data path {path!r} does not exist; run `python -m data_prep.prepare --out {path} ...` "
            "or fix config.data.path"
        )
    meta_path = os.path.join(path, "metadata.json")
    if not os.path.isfile(meta_path):
        raise DataError(
            f"{path!r} has no metadata.json (empty or not prepared); run `python -m data_prep.prepare --out {path} ...`"
        )
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(
            f"{meta_path} is not valid JSON ({e}); the folder is damaged: prepare it again with "
            "`python -m data_prep.prepare`"
        ) from None
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing or not isinstance(meta.get("tokenizer"), dict) or "sha256" not in meta["tokenizer"]:
        raise DataError(
            f"{meta_path} is incomplete (missing {missing or ['tokenizer.sha256']}); prepare the folder "
            "again with `python -m data_prep.prepare`"
        )
    return meta


def check_compatible(meta: dict, seq_len: int, vocab_size: int, tokenizer_hash: str = "", path: str = ""):
    """Stops before training when prepared data and model disagree."""
    if meta["seq_len"] != seq_len:
        raise DataError(
            f"{path}: prepared with seq_len={meta['seq_len']} but config.data.seq_len={seq_len}; "
            f"set --config.data.seq_len={meta['seq_len']} or prepare again with --seq_len {seq_len}"
        )
    if meta["tokenizer"]["vocab_size"] > vocab_size:
        raise DataError(
            f"{path}: token ids go up to {meta['tokenizer']['vocab_size'] - 1}, not below "
            f"config.model.vocab_size={vocab_size}; set "
            f"--config.model.vocab_size={meta['tokenizer']['vocab_size']} or use a matching tokenizer"
        )
    Corpus(path, meta).check_tokenizer(tokenizer_hash)


class DomainSource(grain.sources.RandomAccessDataSource):
    """One (split, domain) of a prepared corpus: records of seq_len + 1 token ids."""

    def __init__(self, path: str, meta: dict, split: str, domain: str):
        st = meta["splits"].get(split, {}).get(domain)
        if not st or not st.get("shards"):
            raise DataError(f"{path}: no shards for domain {domain!r} in split {split!r}")
        self.paths = [os.path.join(path, split, domain, s) for s in st["shards"]]
        for p in self.paths:
            if not os.path.isfile(p):
                raise DataError(f"shard {p} listed in metadata.json is missing; prepare the data again")
        try:
            self._src = grain.sources.ArrayRecordDataSource(self.paths)
            self.n = len(self._src)
        except Exception as e:
            raise DataError(
                f"a shard of {split}/{domain} in {path} does not open ({one_line(e)}); it is truncated or "
                "damaged: prepare the data again"
            ) from None
        self.dtype = np.dtype(meta["dtype"])
        expected = st.get("sequences")
        if expected is not None and self.n != expected:
            raise DataError(
                f"{split}/{domain} in {path} holds {self.n} records but metadata.json lists {expected}; "
                "a shard is truncated or was replaced: prepare the data again"
            )
        record_bytes = meta["record_len"] * self.dtype.itemsize
        for i in (0, self.n - 1) if self.n else ():  # the first and last record read whole
            try:
                rec = self._src[i]
            except Exception as e:
                raise DataError(
                    f"record {i} of {split}/{domain} in {path} does not read ({type(e).__name__}); "
                    "a shard is damaged: prepare the data again"
                ) from None
            if len(rec) != record_bytes:
                raise DataError(
                    f"record {i} of {split}/{domain} in {path} has {len(rec)} bytes, not {record_bytes}; "
                    "a shard is damaged: prepare the data again"
                )

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.frombuffer(self._src[int(i)], self.dtype).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A prepared corpus a run reads: its folder and metadata.json."""

    path: str
    meta: dict

    @property
    def eot_id(self) -> int | None:
        """The token that ends each document: the tokenizer's (data_prep writes it there), or a top-level one
        (hand-made corpora)."""
        value = self.meta.get("tokenizer", {}).get("eot_id", self.meta.get("eot_id"))
        return None if value is None else int(value)

    @property
    def tokenizer_sha256(self) -> str:
        return self.meta["tokenizer"]["sha256"]

    def copy_tokenizer(self, dest):
        """Copies the corpus's tokenizer to `dest` (the run's tokenizer.json, for generate and evaluate)."""
        src = os.path.join(self.path, self.meta["tokenizer"]["file"])
        if os.path.isfile(src):
            dest = epath.Path(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            epath.Path(src).copy(dest, overwrite=True)

    def tokenizer(self):
        """The corpus's tokenizer (tokenizers.Tokenizer), or None for a corpus without a tokenizer file."""
        path = os.path.join(self.path, self.meta["tokenizer"]["file"])
        if not os.path.isfile(path):
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path)

    def bytes_per_token(self, vocab_size: int) -> np.ndarray | None:
        """[vocab_size] UTF-8 bytes of text each token id stands for (bits-per-byte's denominator), or None for a
        corpus without a tokenizer file."""
        tok = self.tokenizer()
        return None if tok is None else token_bytes(tok, vocab_size)

    def check_tokenizer(self, run_sha256: str):
        """A resumed run must read data tokenized the way it started."""
        if run_sha256 and run_sha256 != self.tokenizer_sha256:
            raise DataError(
                f"{self.path}: tokenizer sha256 {self.tokenizer_sha256[:12]}… differs from "
                f"{run_sha256[:12]}… that this run started with; use the data prepared with the run's "
                "tokenizer, or start a new workdir"
            )


def corpus_path(data_cfg) -> str:
    """The folder of the configured corpus (the demo corpus is built on first use)."""
    if data_cfg.source == "demo":
        from resformer_jax.data.demo import demo_corpus

        return demo_corpus(data_cfg.seq_len)
    return data_cfg.path


def open_corpus(data_cfg) -> Corpus | None:
    """The configured prepared corpus, or None for synthetic data."""
    if data_cfg.source == "synthetic":
        return None
    path = corpus_path(data_cfg)
    return Corpus(path, load_metadata(path))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character each byte is written as, inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, vocab_size: int) -> np.ndarray:
    """[vocab_size] UTF-8 bytes of text each id stands for: a byte-level BPE token's characters are one byte each;
    special tokens (end of text) stand for no text, other added tokens (GPT-NeoX's runs of spaces) for their own;
    other tokenizers' tokens count their decoded text's bytes."""
    alphabet = _byte_level_alphabet()
    added = tokenizer.get_added_tokens_decoder()
    out = np.zeros((vocab_size,), np.int64)
    for i in range(min(vocab_size, tokenizer.get_vocab_size())):
        piece = tokenizer.id_to_token(i)
        if piece is None or (i in added and added[i].special):
            continue
        if i in added:
            out[i] = len(added[i].content.encode("utf-8"))
            continue
        if all(ch in alphabet for ch in piece):
            out[i] = len(piece)
        else:
            out[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return out
