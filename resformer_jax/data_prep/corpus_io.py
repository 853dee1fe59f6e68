"""What both preparation paths share (the threaded one in prepare.py, the Apache Beam one in beam_pipeline.py):
input files and their documents, the tokenizer, the end-of-text token, and the ArrayRecord shard writer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterator

import numpy as np

from resformer_jax.errors import UserError

SPLIT_NAMES = {
    "train": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "holdout": "validation",
    "test": "test",
}
TEXT_EXTS = (".jsonl", ".jsonl.zst", ".json.zst", ".parquet", ".txt")
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


class PrepareError(UserError):
    """Bad input to prepare; the message names the cause and the fix."""


class BadInputFile(PrepareError):
    """One input file is truncated, corrupt or malformed (--skip_bad_files counts and skips it)."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_tokens(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def list_files(inputs: list[str]) -> list[str]:
    files = []
    for p in inputs:
        if not os.path.exists(p):
            raise PrepareError(f"input path {p!r} does not exist; pass existing files or folders to --input")
        if os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs.sort()
                files += [os.path.join(root, n) for n in sorted(names) if n.endswith(TEXT_EXTS)]
        elif p.endswith(TEXT_EXTS):
            files.append(p)
        else:
            raise PrepareError(f"{p!r} is not one of {', '.join(TEXT_EXTS)}")
    if not files:
        raise PrepareError(f"no {', '.join(TEXT_EXTS)} files under {inputs}; check --input")
    return files


def split_of(path: str, default: str) -> str:
    for part in reversed(os.path.normpath(path).split(os.sep)[:-1]):
        if part.lower() in SPLIT_NAMES:
            return SPLIT_NAMES[part.lower()]
    return default


def _zst_bytes(path: str) -> Iterator[bytes]:
    """The decompressed bytes of every zstd frame in a file; a truncated or corrupt file is an error
    (a stream reader alone stops quietly at a cut-off frame)."""
    import zstandard

    with open(path, "rb") as raw:
        obj, fed = zstandard.ZstdDecompressor().decompressobj(), False
        while True:
            chunk = raw.read(1 << 20)
            if not chunk:
                break
            while chunk:
                fed = True
                try:
                    out = obj.decompress(chunk)
                except zstandard.ZstdError as e:
                    raise BadInputFile(f"{path}: not a valid zstd file ({e})") from None
                if out:
                    yield out
                if obj.eof:  # a frame ended: the rest of the chunk starts the next frame
                    chunk, obj = obj.unused_data, zstandard.ZstdDecompressor().decompressobj()
                    fed = bool(chunk)
                else:
                    chunk = b""
        if fed and not obj.eof:
            raise BadInputFile(f"{path}: the zstd stream ends inside a frame (the file is truncated)")


def _lines(path: str, byte_chunks: Iterator[bytes]) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line, decoded as UTF-8; a bad byte names the file and line."""
    rest, n = b"", 0
    for chunk in byte_chunks:
        rest += chunk
        *full, rest = rest.split(b"\n")
        for raw in full:
            n += 1
            yield n, _decode(path, n, raw)
    if rest:
        yield n + 1, _decode(path, n + 1, rest)


def _decode(path: str, n: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInputFile(f"{path}:{n}: not UTF-8 ({e.reason} at byte {e.start} of the line)") from None


def _file_bytes(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(1 << 20), b"")


def from_record(rec, where: str, domain: str) -> tuple[str, str]:
    """(domain, text) of one SlimPajama-style record."""
    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
        raise BadInputFile(
            f'{where}: the record has no "text" string field (keys: '
            f"{sorted(rec) if isinstance(rec, dict) else type(rec).__name__})"
        )
    meta = rec.get("meta") or {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError:
            raise BadInputFile(f'{where}: its "meta" field is a string that is not JSON') from None
    return meta.get("redpajama_set_name", domain), rec["text"]


def from_json_line(path: str, n: int, line: bytes | str, domain: str) -> tuple[str, str]:
    """(domain, text) of one JSON line, as read or decoded (n: its line number, for messages)."""
    if isinstance(line, bytes):
        line = _decode(path, n, line.rstrip(b"\n"))
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadInputFile(f"{path}:{n}: not a JSON line ({e.msg} at column {e.colno})") from None
    return from_record(rec, f"{path}:{n}", domain)


def read_documents(path: str, domain: str) -> Iterator[tuple[str, str]]:
    """Yields (domain, text) for every document in one file; a malformed file raises BadInputFile naming
    the file (and the line, for JSON lines)."""
    if path.endswith(".txt"):
        with open(path, "rb") as f:
            raw = f.read()
        try:
            yield domain, raw.decode("utf-8")
        except UnicodeDecodeError as e:
            at = raw[: e.start].count(b"\n") + 1
            raise BadInputFile(f"{path}:{at}: not UTF-8 ({e.reason}); convert the file to UTF-8") from None
    elif path.endswith((".jsonl.zst", ".json.zst", ".jsonl")):
        chunks = _zst_bytes(path) if path.endswith(".zst") else _file_bytes(path)
        for n, line in _lines(path, chunks):
            if line.strip():
                yield from_json_line(path, n, line, domain)
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:
            raise BadInputFile(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        if "text" not in table.column_names:
            raise BadInputFile(f'{path}: no "text" column (columns: {table.column_names})')
        for i, rec in enumerate(table.to_pylist()):
            yield from_record(rec, f"{path} row {i}", domain)


def load_tokenizer(spec: str, files: list[str], out: str, docs_of=None):
    """tokenizer.json path | hub name (needs network) | train:VOCAB (byte-level BPE trained here)."""
    from tokenizers import Tokenizer

    if spec.startswith("train:"):
        try:
            vocab = int(spec.split(":", 1)[1])
        except ValueError:
            raise PrepareError(f"--tokenizer {spec!r}: expected train:VOCAB_SIZE, e.g. train:8192") from None
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        train_files = [f for f in files if split_of(f, "train") == "train"] or files
        docs_of = docs_of or (lambda f: read_documents(f, "default"))
        tok.train_from_iterator((t for f in train_files for _, t in docs_of(f)), trainer)
        path = os.path.join(out, "tokenizer.json")
        tok.save(path)
        return tok, path
    if os.path.isfile(spec):
        try:
            tok = Tokenizer.from_file(spec)
        except Exception as e:
            raise PrepareError(f"--tokenizer {spec!r} is not a tokenizers JSON file ({e})") from None
        path = os.path.join(out, "tokenizer.json")
        if os.path.abspath(spec) != os.path.abspath(path):
            shutil.copyfile(spec, path)
        return tok, path
    if spec.endswith(".json") or spec.count("/") > 1 or spec.startswith((".", "/", "~")):
        # a path (a hub name is OWNER/NAME, no extension, one slash): say the file is missing, not the hub's rules
        raise PrepareError(
            f"--tokenizer {spec!r}: no such file; check the path (or pass a hub name like EleutherAI/gpt-neox-20b, "
            "or train:VOCAB_SIZE)"
        )
    try:
        tok = Tokenizer.from_pretrained(spec)
    except Exception as e:
        raise PrepareError(
            f"--tokenizer {spec!r} is neither a file nor a hub name that loads here ({e}); "
            "pass a local tokenizer.json or train:VOCAB_SIZE"
        ) from None
    path = os.path.join(out, "tokenizer.json")
    tok.save(path)
    return tok, path


def eot_id_of(tok) -> int:
    for name in EOT_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise PrepareError(f"the tokenizer has none of {EOT_CANDIDATES} as an end-of-text token; add one")


class ShardWriter:
    """Packs one (split, domain) token stream into fixed-length records across shards."""

    def __init__(self, folder: str, record_len: int, dtype, per_shard: int, prefix: str = "shard"):
        from array_record.python.array_record_module import ArrayRecordWriter

        self._writer_cls = ArrayRecordWriter
        self.folder, self.record_len, self.dtype, self.per_shard = folder, record_len, dtype, per_shard
        self.prefix = prefix
        os.makedirs(folder, exist_ok=True)
        self.buf = np.zeros(0, dtype)
        self.shards: list[str] = []
        self.writer, self.in_shard, self.records = None, 0, 0

    def add(self, ids):
        self.buf = np.concatenate([self.buf, np.asarray(ids, self.dtype)])
        n = len(self.buf) // self.record_len
        for i in range(n):
            self._write(self.buf[i * self.record_len : (i + 1) * self.record_len])
        self.buf = self.buf[n * self.record_len :]

    def _write(self, rec):
        if self.writer is None or self.in_shard == self.per_shard:
            self._close_shard()
            name = f"{self.prefix}-{len(self.shards):05d}.array_record"
            self.writer = self._writer_cls(os.path.join(self.folder, name), "group_size:1")
            self.shards.append(name)
        self.writer.write(rec.tobytes())
        self.in_shard += 1
        self.records += 1

    def _close_shard(self):
        if self.writer is not None:
            self.writer.close()
            self.writer, self.in_shard = None, 0

    def close(self) -> int:
        self._close_shard()
        return len(self.buf)  # tokens left over that fill no whole record


@dataclasses.dataclass(frozen=True)
class PrepareJob:
    """What one preparation writes, as `prepare` was asked (every step below reads it, none changes it); the
    defaults are the command's."""

    tokenizer: str  # tokenizer.json | hub name | train:VOCAB_SIZE
    seq_len: int = 2048
    budgets: dict = dataclasses.field(default_factory=dict)  # train split: domain -> tokens
    domain: str = "default"  # of files without meta (.txt)
    split: str = "train"  # of files outside train/ or validation/ folders
    seed: int = 0
    shuffle_docs: bool = False
    records_per_shard: int = 65536
    batch_docs: int = 256
    command: str = ""
    quiet: bool = False
    skip_bad_files: bool = False
    runner: str = "threads"  # threads | beam
    beam_options: str = ""
    beam_packing: str = "domain"  # domain | file
