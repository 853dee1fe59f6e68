"""Raw text -> packed, tokenized ArrayRecord shards per split and domain.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

from resformer_jax.data_prep.corpus_io import (
    BadInputFile,
    PrepareError,
    PrepareJob,
    ShardWriter,
    eot_id_of,
    list_files,
    load_tokenizer,
    parse_tokens,
    read_documents,
    sha256_file,
    split_of,
)


def prepare(inputs: list[str], tokenizer: str, out: str, *, workers: int = 0, **options: Any) -> dict:
    """Library form of the command; `options` are PrepareJob's fields (seq_len, budgets, domain, ...). Returns the
    metadata it writes.

    Atomic: everything is written to a folder beside `out` and renamed into place at the end, so a
    folder with metadata.json is always complete (an interrupted run leaves the previous corpus as it
    was, and a `.partial-PID` folder that never looks prepared)."""
    if workers > 0:
        os.environ["RAYON_NUM_THREADS"] = str(workers)  # the tokenizers library's thread pool
    job = PrepareJob(tokenizer=tokenizer, **options)
    if job.seq_len < 1:
        raise PrepareError(f"--seq_len must be positive, got {job.seq_len}")
    if job.runner not in ("threads", "beam"):
        raise PrepareError(f"--runner={job.runner!r}: use threads or beam")
    if job.runner == "beam":
        from resformer_jax.data_prep import beam_pipeline

        beam_pipeline.require_beam()
        files = beam_pipeline.list_inputs(inputs)
    else:
        files = list_files(inputs)
    out = out.rstrip("/") or out
    if "://" in out:
        from resformer_jax import storage

        try:
            storage.check_supported(out)
        except storage.StorageError as e:
            raise PrepareError(str(e)) from None
        if job.runner != "beam":
            return _prepare_then_upload(out, files, job)
        return _prepare_remote(out, files, job)
    if os.path.exists(out) and not os.path.isdir(out):
        raise PrepareError(
            f"--out {out!r} is an existing file; name a folder (new, empty, or a prepared corpus to replace)"
        )
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, "metadata.json")):
        raise PrepareError(
            f"--out {out!r} is a non-empty folder that is not a prepared corpus; name a new or "
            "empty folder (prepare replaces only its own output)"
        )
    work = f"{out}.partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        os.makedirs(work)
        meta = _prepare_into(work, files, job)
        if os.path.isdir(out):  # swap: the old corpus stays whole until the new one is
            old = f"{out}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(work, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not job.quiet:
        print(f"[prepare] wrote {out}/metadata.json", file=sys.stderr, flush=True)
    return meta


def _prepare_then_upload(out, files, job: PrepareJob) -> dict:
    """--out on object storage with the threaded runner: ArrayRecord writes local files only, so the corpus
    is prepared in a local temporary folder and uploaded. No rename there either: the old metadata.json
    is removed first and the new one uploaded last, so a half-uploaded corpus never looks prepared."""
    from etils import epath

    dst = epath.Path(out)
    if (dst / "metadata.json").exists():
        (dst / "metadata.json").unlink()
    local = tempfile.mkdtemp(prefix="resformer_prepare_")
    try:
        meta = _prepare_into(local, files, job)
        from resformer_jax.storage import files_under

        files_up = [p for p in files_under(local) if p.name != "metadata.json"]
        for f in files_up:
            target = dst / f.relative_to(local)
            target.parent.mkdir(parents=True, exist_ok=True)
            f.copy(target, overwrite=True)
        (epath.Path(local) / "metadata.json").copy(dst / "metadata.json", overwrite=True)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    if not job.quiet:
        print(f"[prepare] uploaded {len(files_up) + 1} files; wrote {out}/metadata.json", file=sys.stderr, flush=True)
    return meta


def _prepare_remote(out, files, job: PrepareJob) -> dict:
    """--out on object storage (Beam only): no rename there, so metadata.json is removed first and written last;
    the tokenizer is prepared locally and copied up."""
    from apache_beam.io.filesystems import FileSystems

    meta_path = f"{out}/metadata.json"
    if FileSystems.exists(meta_path):
        FileSystems.delete([meta_path])
    local = tempfile.mkdtemp(prefix="resformer_prepare_")
    try:
        meta = _prepare_into(local, files, job, shards_out=out, write_meta=False)
        with (
            open(os.path.join(local, "tokenizer.json"), "rb") as src,
            FileSystems.create(f"{out}/tokenizer.json") as dst,
        ):
            dst.write(src.read())
        with FileSystems.create(meta_path) as f:
            f.write(json.dumps(meta, indent=2).encode())
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return meta


def _prepare_into(out, files, job: PrepareJob, shards_out=None, write_meta=True) -> dict:
    skipped: dict[str, str] = {}
    seq_len, budgets, seed, shuffle_docs, split = job.seq_len, job.budgets, job.seed, job.shuffle_docs, job.split

    def log(msg):
        if not job.quiet:
            print(msg, file=sys.stderr, flush=True)

    def docs_of(path, dom="default"):
        """All documents of one file, or none (counted) when it is bad and --skip_bad_files is on."""
        if path in skipped:
            return []
        try:
            return list(read_documents(path, dom))
        except BadInputFile as e:
            if not job.skip_bad_files:
                raise PrepareError(
                    f"{e}. Fix or remove the file, or pass --skip_bad_files to skip such files"
                ) from None
            skipped[path] = str(e)
            log(f"[prepare] WARNING: skipping a bad input file: {e}")
            return []

    tok, tok_path = load_tokenizer(job.tokenizer, files, out, docs_of)
    if job.runner == "beam":
        from resformer_jax.data_prep import beam_pipeline

        vocab = tok.get_vocab_size(with_added_tokens=True)
        eot = eot_id_of(tok)
        with open(tok_path) as f:
            tok_json = f.read()
        t0 = time.time()
        stats, skipped_list = beam_pipeline.run_pipeline(files, tok, tok_json, eot, shards_out or out, job)
        skipped.update({x["file"]: x["reason"] for x in skipped_list})
        total = sum(st["tokens"] for doms in stats.values() for st in doms.values())
        log(f"[prepare] beam: {total:,} tokens in {time.time() - t0:.1f}s ({job.beam_packing} packing)")
        return _finish(out, job, stats, tok_path, vocab, eot, skipped, log, write_meta)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eot = eot_id_of(tok)
    dtype = np.uint16 if vocab <= 65535 else np.uint32
    writers: dict[tuple[str, str], ShardWriter] = {}
    stats = {}  # domain -> split -> counts
    t0, total_tokens = time.time(), 0

    for fi, path in enumerate(files):
        sp = split_of(path, split)
        docs = docs_of(path, job.domain)
        if shuffle_docs:  # seeded per file, so every runner (and a resumed preparation) gets the same order
            docs = [docs[i] for i in np.random.default_rng([seed, fi]).permutation(len(docs))]
        for b in range(0, len(docs), job.batch_docs):
            chunk = docs[b : b + job.batch_docs]
            encs = tok.encode_batch([t for _, t in chunk], add_special_tokens=False)
            for (dom, _), enc in zip(chunk, encs):
                st = stats.setdefault(sp, {}).setdefault(dom, {"documents": 0, "tokens": 0})
                if sp == "train" and dom in budgets and st["tokens"] >= budgets[dom]:
                    continue  # this domain's budget is spent
                ids = enc.ids + [eot]
                key = (sp, dom)
                if key not in writers:
                    writers[key] = ShardWriter(os.path.join(out, sp, dom), seq_len + 1, dtype, job.records_per_shard)
                writers[key].add(ids)
                st["documents"] += 1
                st["tokens"] += len(ids)
                total_tokens += len(ids)
        rate = total_tokens / max(time.time() - t0, 1e-9)
        log(f"[prepare] {fi + 1}/{len(files)} files, {total_tokens:,} tokens ({rate:,.0f} tok/s): {path}")

    for (sp, dom), w in writers.items():
        left = w.close()
        stats[sp][dom].update(
            sequences=w.records, tokens_in_sequences=w.records * (seq_len + 1), tokens_dropped=left, shards=w.shards
        )
    log(
        f"[prepare] {total_tokens:,} tokens in {time.time() - t0:.1f}s"
        + (f"; skipped {len(skipped)} bad files (listed in metadata.json)" if skipped else "")
    )
    return _finish(out, job, stats, tok_path, vocab, eot, skipped, log, write_meta)


def _finish(out, job: PrepareJob, stats, tok_path, vocab, eot, skipped, log, write_meta=True) -> dict:
    """Drops (split, domain) streams without a whole record, and writes metadata.json (last)."""
    seq_len = job.seq_len
    dtype = np.uint16 if vocab <= 65535 else np.uint32
    for sp, doms in stats.items():
        for dom, st in list(doms.items()):
            if st.get("sequences", 0) == 0:
                log(
                    f"[prepare] note: split {sp!r} domain {dom!r} has no full sequence "
                    f"({st['tokens']} tokens < {seq_len + 1}); it is left out of that split"
                )
                shutil.rmtree(os.path.join(out, sp, dom), ignore_errors=True)
                st.update(sequences=0, shards=[])
    all_domains = sorted({d for doms in stats.values() for d in doms})
    for sp in ("train", "validation"):
        for dom in all_domains:
            if dom not in stats.get(sp, {}) or not stats[sp][dom]["sequences"]:
                log(f"[prepare] note: domain {dom!r} has no data in split {sp!r}")
    meta = {
        "format": "resformer_jax.packed.v1",
        "tokenizer": {
            "file": "tokenizer.json",
            "sha256": sha256_file(tok_path),
            "vocab_size": vocab,
            "eot_id": eot,
            "spec": job.tokenizer,
        },
        "seq_len": seq_len,
        "record_len": seq_len + 1,
        "dtype": np.dtype(dtype).name,
        "seed": job.seed,
        "shuffle_docs": job.shuffle_docs,
        "budgets": job.budgets,
        "splits": stats,
        "command": job.command or " ".join(sys.argv),
        "skipped_files": [{"file": f, "reason": r} for f, r in sorted(skipped.items())],
        "runner": job.runner,
        # domain: each (split, domain) packed as one stream in file and document order (threads, and Beam's
        # default); file: Beam packed each input file on its own (records never span files).
        "packing": job.beam_packing if job.runner == "beam" else "domain",
    }
    if write_meta:
        with open(os.path.join(out, "metadata.json.tmp"), "w") as f:
            json.dump(meta, f, indent=2)
        os.replace(os.path.join(out, "metadata.json.tmp"), os.path.join(out, "metadata.json"))
    return meta


def main(argv=None, prog: str = "python -m data_prep.prepare"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="files or folders (.jsonl[.zst], .parquet, .txt)")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json | hub name | train:VOCAB_SIZE")
    p.add_argument("--out", required=True)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--budget", nargs="*", default=[], help="DOMAIN=TOKENS (e.g. RedPajamaC4=4B), train split")
    p.add_argument("--workers", type=int, default=0, help="tokenizer threads (0: all cores)")
    p.add_argument("--domain", default="default", help="domain of files without meta (.txt)")
    p.add_argument("--split", default="train", help="split of files outside train/ or validation/ folders")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle_docs", action="store_true", help="shuffle documents within each file by --seed")
    p.add_argument("--records_per_shard", type=int, default=65536)
    p.add_argument(
        "--runner",
        default="threads",
        choices=("threads", "beam"),
        help="threads: this machine; beam: an Apache Beam pipeline (pip install -e '.[beam]')",
    )
    p.add_argument(
        "--beam_options",
        default="",
        help='Beam pipeline options, e.g. "--runner=DirectRunner --direct_num_workers=2 '
        '--direct_running_mode=multi_processing" or "--runner=DataflowRunner --project=P ..."',
    )
    p.add_argument(
        "--beam_packing",
        default="domain",
        choices=("domain", "file"),
        help="domain: records identical to the threaded path; file: pack each file on its own (parallel)",
    )
    p.add_argument(
        "--skip_bad_files",
        action="store_true",
        help="skip truncated or malformed input files (counted, listed in metadata.json) instead of stopping",
    )
    a = p.parse_args(argv)
    try:
        budgets = {}
        for b in a.budget:
            if "=" not in b:
                raise PrepareError(f"--budget {b!r}: expected DOMAIN=TOKENS, e.g. RedPajamaC4=4B")
            k, v = b.split("=", 1)
            try:
                budgets[k] = parse_tokens(v)
            except ValueError:
                raise PrepareError(
                    f"--budget {b!r}: {v!r} is not a token count; use e.g. {k}=4B, 500M or 12000"
                ) from None
        fields = (
            "seq_len domain split seed shuffle_docs records_per_shard skip_bad_files runner beam_options beam_packing"
        )
        prepare(
            a.input,
            a.tokenizer,
            a.out,
            workers=a.workers,
            budgets=budgets,
            command=" ".join([prog, *(sys.argv[1:] if argv is None else argv)]),
            **{f: getattr(a, f) for f in fields.split()},
        )
    except (PrepareError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
