"""Corpus preparation as an Apache Beam pipeline: the same output as the threaded path, on any runner.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from resformer_jax.data_prep.corpus_io import PrepareJob

SPLIT_BYTES = 64 << 20  # uncompressed .jsonl files larger than this are read in ranges of this size


def require_beam():
    try:
        import apache_beam  # noqa: F401
    except ImportError:
        from resformer_jax.data_prep.corpus_io import PrepareError

        raise PrepareError(
            "--runner=beam needs Apache Beam: pip install -e '.[beam]' (or pip install apache-beam)"
        ) from None


def _fs():
    from apache_beam.io.filesystems import FileSystems

    return FileSystems


def remote(path: str) -> bool:
    return "://" in path


def list_inputs(inputs: list[str]) -> list[str]:
    """Input files in a fixed order: local folders walked like the threaded path; remote paths matched
    with Beam's filesystems (a folder, or a glob)."""
    from resformer_jax.data_prep.corpus_io import TEXT_EXTS, PrepareError, list_files

    local = [p for p in inputs if not remote(p)]
    files = list_files(local) if local else []
    for p in inputs:
        if remote(p):
            pattern = p if any(c in p for c in "*?[") else p.rstrip("/") + "/**"
            found = sorted(
                m.path for r in _fs().match([pattern]) for m in r.metadata_list if m.path.endswith(TEXT_EXTS)
            )
            if not found:
                raise PrepareError(f"no {', '.join(TEXT_EXTS)} files match {p!r}; check --input")
            files += found
    return files


def _local_copy(path: str) -> str:
    """A local file to read: the path itself, or a temporary copy of a remote one."""
    if not remote(path):
        return path
    fd, tmp = tempfile.mkstemp(suffix=os.path.basename(path))
    with os.fdopen(fd, "wb") as out, _fs().open(path) as src:
        while chunk := src.read(1 << 20):
            out.write(chunk)
    return tmp


def work_units(files: list[str]) -> list[tuple[int, str, int, int]]:
    """(file index, path, start byte, end byte); end -1: the whole file."""
    units = []
    for fi, path in enumerate(files):
        size = os.path.getsize(path) if not remote(path) else _fs().match([path])[0].metadata_list[0].size_in_bytes
        if path.endswith(".jsonl") and not remote(path) and size > SPLIT_BYTES:
            units += [(fi, path, s, min(s + SPLIT_BYTES, size)) for s in range(0, size, SPLIT_BYTES)]
        else:
            units.append((fi, path, 0, -1))
    return units


def read_unit(unit, domain: str, split: str, seed: int, shuffle_docs: bool, skip_bad_files: bool):
    """Yields ((split, domain), (file index, position, text)) for one work unit; position orders documents
    within a file (byte offset for ranged .jsonl reads, document index otherwise)."""
    from resformer_jax.data_prep.corpus_io import BadInputFile, PrepareError, from_json_line, read_documents, split_of

    fi, path, start, end = unit
    sp = split_of(path, split)
    if end >= 0:  # a byte range of a large .jsonl: the lines that start inside it
        with open(path, "rb") as f:
            f.seek(start)
            if start > 0:
                f.seek(start - 1)
                if f.read(1) != b"\n":
                    f.readline()  # the line that started in the previous range is that range's
            while f.tell() < end:
                pos = f.tell()
                line = f.readline()
                if not line:
                    break
                n = pos  # a byte offset stands in for the line number in messages
                if line.strip():
                    dom, text = from_json_line(path, n, line, domain)
                    yield (sp, dom), (fi, pos, text)
        return
    local = _local_copy(path)
    try:
        docs = list(read_documents(local, domain))
    except BadInputFile as e:
        if not skip_bad_files:
            raise PrepareError(f"{e}. Fix or remove the file, or pass --skip_bad_files to skip such files") from None
        yield ("__skipped__", path), (fi, 0, str(e))
        return
    finally:
        if local != path:
            os.remove(local)
    order = np.random.default_rng([seed, fi]).permutation(len(docs)) if shuffle_docs else range(len(docs))
    for pos, i in enumerate(order):
        dom, text = docs[i]
        yield (sp, dom), (fi, pos, text)


class Tokenize:
    """DoFn body: the tokenizer is rebuilt from its JSON once per worker."""

    def __init__(self, tokenizer_json: str, eot: int):
        self.tokenizer_json, self.eot, self.tok = tokenizer_json, eot, None

    def __call__(self, kv):
        key, (fi, pos, text) = kv
        if key[0] == "__skipped__":
            return key, (fi, pos, text)
        if self.tok is None:
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_str(self.tokenizer_json)
        ids = self.tok.encode(text, add_special_tokens=False).ids + [self.eot]
        return key, (fi, pos, np.asarray(ids, np.uint32))


def pack_and_write(kv, out: str, seq_len: int, dtype: str, budgets: dict, records_per_shard: int, packing: str):
    """One (split, domain) stream (or one file's part of it): ordered, budgeted, packed, written. Yields its
    stats as (split, domain, stats)."""
    from resformer_jax.data_prep.corpus_io import ShardWriter

    (sp, dom, part), docs = kv
    docs = sorted(docs, key=lambda d: (d[0], d[1]))
    folder = f"{out}/{sp}/{dom}"
    prefix = "shard" if packing == "domain" else f"file{part:05d}-shard"
    local = tempfile.mkdtemp(prefix="resformer_beam_")
    w = ShardWriter(local, seq_len + 1, np.dtype(dtype), records_per_shard, prefix=prefix)
    st: dict[str, Any] = {"documents": 0, "tokens": 0}
    for _, _, ids in docs:
        if sp == "train" and dom in budgets and st["tokens"] >= budgets[dom]:
            continue  # this domain's budget is spent (per file under file packing: see metadata "packing")
        w.add(ids)
        st["documents"] += 1
        st["tokens"] += len(ids)
    left = w.close()
    fs = _fs()
    for name in w.shards:
        dst = f"{folder}/{name}"
        if not remote(dst):
            os.makedirs(folder, exist_ok=True)
        with open(os.path.join(local, name), "rb") as src, fs.create(dst) as f:
            f.write(src.read())
        os.remove(os.path.join(local, name))
    os.rmdir(local)
    st.update(
        sequences=w.records, tokens_in_sequences=w.records * (seq_len + 1), tokens_dropped=left, shards=list(w.shards)
    )
    yield sp, dom, st


def merge_stats(parts: list[tuple[str, str, dict]]) -> dict:
    stats: dict[str, dict[str, dict]] = {}
    for sp, dom, st in sorted(parts, key=lambda x: (x[0], x[1], x[2]["shards"])):
        cur = stats.setdefault(sp, {}).setdefault(
            dom,
            {"documents": 0, "tokens": 0, "sequences": 0, "tokens_in_sequences": 0, "tokens_dropped": 0, "shards": []},
        )
        for k in ("documents", "tokens", "sequences", "tokens_in_sequences", "tokens_dropped"):
            cur[k] += st[k]
        cur["shards"] += st["shards"]
    return stats


def run_pipeline(
    files: list[str], tok, tokenizer_json: str, eot: int, out: str, job: PrepareJob
) -> tuple[dict, list[dict]]:
    """Runs the pipeline for `job` (corpus_io.PrepareJob), writing shards under `out`; returns (stats per split and
    domain, skipped files)."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    packing, seq_len, budgets = job.beam_packing, job.seq_len, job.budgets
    if packing not in ("domain", "file"):
        from resformer_jax.data_prep.corpus_io import PrepareError

        raise PrepareError(f"--beam_packing={packing!r}: use domain or file")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vocab <= 65535 else "uint32"
    units = work_units(files)
    results = f"{out}/_beam_stats"
    opts = PipelineOptions(shlex.split(job.beam_options or "--runner=DirectRunner"))
    with beam.Pipeline(options=opts) as p:
        docs = (
            p
            | "units" >> beam.Create(units)
            | "read" >> beam.FlatMap(read_unit, job.domain, job.split, job.seed, job.shuffle_docs, job.skip_bad_files)
            | "tokenize" >> beam.Map(Tokenize(tokenizer_json, eot))
        )
        skipped = docs | "skipped" >> beam.Filter(lambda kv: kv[0][0] == "__skipped__")
        keyed = (
            docs
            | "kept" >> beam.Filter(lambda kv: kv[0][0] != "__skipped__")
            | "key" >> beam.Map(lambda kv: ((kv[0][0], kv[0][1], kv[1][0] if packing == "file" else 0), kv[1]))
        )
        stats = (
            keyed
            | "group" >> beam.GroupByKey()
            | "pack" >> beam.FlatMap(pack_and_write, out, seq_len, dtype, budgets, job.records_per_shard, packing)
        )
        (
            stats
            | "stats_json" >> beam.Map(json.dumps)
            | "write_stats" >> beam.io.WriteToText(f"{results}/stats", file_name_suffix=".jsonl")
        )
        (
            skipped
            | "skipped_json" >> beam.Map(lambda kv: json.dumps({"file": kv[0][1], "reason": kv[1][2]}))
            | "write_skipped" >> beam.io.WriteToText(f"{results}/skipped", file_name_suffix=".jsonl")
        )
    fs = _fs()
    parts, skipped_files = [], []
    for r in fs.match([f"{results}/*.jsonl"]):
        for m in r.metadata_list:
            with fs.open(m.path) as f:
                rows = [json.loads(x) for x in f.read().decode().splitlines() if x.strip()]
            if os.path.basename(m.path).startswith("stats"):
                parts += [tuple(x) for x in rows]
            else:
                skipped_files += rows
    fs.delete([results])
    return merge_stats(parts), sorted(skipped_files, key=lambda x: x["file"])
