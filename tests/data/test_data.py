"""Corpus preparation and the grain pipeline."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from commands import run_command

from resformer_jax.data.pipeline import (
    BatchReader,
    DataError,
    DomainSource,
    Mixture,
    check_compatible,
    load_metadata,
    train_iterator,
    train_reader,
)
from resformer_jax.data_prep.prepare import PrepareError, prepare
from resformer_jax.presets import tiny_config

# one worker runs this file, so its module fixtures are built once
pytestmark = pytest.mark.xdist_group("data")

SEQ = 128


@pytest.fixture(scope="module")
def slimpajama(tmp_path_factory, request):
    from conftest import SHARED_DATA

    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent: these tests need ../shared/data beside the checkout")
    out = str(tmp_path_factory.mktemp("sp"))
    prepare(
        [str(SHARED_DATA / "slimpajama_sample")],
        str(SHARED_DATA / "tokenizers" / "gpt-neox-20b.json"),
        out,
        seq_len=SEQ,
        quiet=True,
    )
    return out, SHARED_DATA


def _docs(path):
    import zstandard

    with open(path, "rb") as f:
        text = zstandard.ZstdDecompressor().stream_reader(f).read().decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.slow  # over 12 s in the fast tier
def test_token_counts_equal_independent_count(slimpajama):
    out, shared = slimpajama
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(shared / "tokenizers" / "gpt-neox-20b.json"))
    meta = load_metadata(out)
    for split, fname in (
        ("train", "train/chunk1/example_train_0.jsonl.zst"),
        ("validation", "validation/chunk1/example_holdout_0.jsonl.zst"),
    ):
        counts, docs = {}, {}
        for d in _docs(shared / "slimpajama_sample" / fname):
            dom = d["meta"]["redpajama_set_name"]
            counts[dom] = counts.get(dom, 0) + len(tok.encode(d["text"], add_special_tokens=False).ids) + 1
            docs[dom] = docs.get(dom, 0) + 1
        for dom, n in counts.items():
            st = meta["splits"][split][dom]
            assert st["tokens"] == n, (split, dom)
            assert st["documents"] == docs[dom]
            assert st["sequences"] == n // (SEQ + 1)
    assert "RedPajamaArXiv" not in meta["splits"]["train"]  # only in validation: reported, not fatal
    assert meta["splits"]["validation"]["RedPajamaArXiv"]["documents"] == 1
    assert meta["tokenizer"]["sha256"].startswith("56ac4821e129")
    assert meta["tokenizer"]["vocab_size"] == 50277 and meta["tokenizer"]["eot_id"] == 0


def test_first_sequence_decodes_to_first_document_then_eot(slimpajama):
    out, shared = slimpajama
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    meta = load_metadata(out)
    first = {}
    for d in _docs(shared / "slimpajama_sample/train/chunk1/example_train_0.jsonl.zst"):
        first.setdefault(d["meta"]["redpajama_set_name"], d["text"])
    for dom, text in first.items():
        src = DomainSource(out, meta, "train", dom)
        ids = tok.encode(text, add_special_tokens=False).ids
        need = len(ids) + 1
        stream = np.concatenate([src[i] for i in range(min(len(src), need // (SEQ + 1) + 1))])
        if len(stream) < need:
            continue  # the first document is longer than the domain's whole stream
        assert list(stream[: len(ids)]) == ids, dom
        assert stream[len(ids)] == 0, f"{dom}: end-of-text must follow the document"
        assert tok.decode(list(stream[: len(ids)])) == text, dom


def test_process_slices_are_disjoint_and_form_the_global_batch(slimpajama):
    out, _ = slimpajama
    c = tiny_config()
    c.data.source, c.data.path, c.data.seq_len, c.model.vocab_size = "array_record", out, SEQ, 50277
    read, _ = train_reader(c)
    whole = BatchReader(read, 8, 0, 1)(5)
    p0, p1 = BatchReader(read, 8, 0, 2)(5), BatchReader(read, 8, 1, 2)(5)
    np.testing.assert_array_equal(np.concatenate([p0, p1]), whole)
    rows = {r.tobytes() for r in np.concatenate([p0, p1])}
    assert len(rows) == 8


def test_restored_iterator_state_gives_same_batches(slimpajama):
    out, _ = slimpajama
    c = tiny_config()
    c.data.source, c.data.path, c.data.seq_len, c.model.vocab_size = "array_record", out, SEQ, 50277
    it = train_iterator(c)
    for _ in range(3):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(3)]
    it2 = train_iterator(c)
    it2.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(it2), w)
    # ... and a batch is a pure function of the step: a fresh iterator positioned at step 3 agrees.
    it3 = train_iterator(c)
    it3.set_state({"next_index": 3})
    np.testing.assert_array_equal(next(it3), want[0])


def test_domain_proportions_follow_weights(slimpajama):
    out, _ = slimpajama
    meta = load_metadata(out)
    from resformer_jax.data.pipeline import domain_weights

    w = domain_weights(meta, "train", None)
    assert "RedPajamaArXiv" not in w and abs(sum(w.values()) - 1) < 1e-9
    assert w["RedPajamaCommonCrawl"] == pytest.approx(0.5 / 0.95)
    sizes = [meta["splits"]["train"][d]["sequences"] for d in w]
    mix = Mixture(sizes, list(w.values()), seed=7)
    draws = [mix(g)[0] for g in range(5000)]
    for i, (dom, weight) in enumerate(w.items()):
        assert abs(draws.count(i) / 5000 - weight) < 0.02, dom
    # Every record of a domain is visited once per epoch.
    small = Mixture([5, 7], [0.5, 0.5], seed=1)
    recs = {}
    for g in range(48):
        d, r = small(g)
        recs.setdefault(d, []).append(r)
    assert sorted(recs[0][:5]) == list(range(5)) and sorted(recs[1][:7]) == list(range(7))


def _tok_ids(out, text):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(out, "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_txt_jsonl_parquet_and_trained_tokenizer(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = tmp_path / "raw"
    (raw / "train").mkdir(parents=True)
    (raw / "validation").mkdir()
    words = "the quick brown fox jumps over the lazy dog while value residual learning helps deep models"
    texts = [f"{words} number {i}. " * 5 for i in range(40)]
    with open(raw / "train" / "a.jsonl", "w") as f:
        for t in texts[:20]:
            f.write(json.dumps({"text": t, "meta": {"redpajama_set_name": "RedPajamaC4"}}) + "\n")
    pq.write_table(
        pa.table({"text": texts[20:30], "meta": [{"redpajama_set_name": "RedPajamaBook"}] * 10}),
        raw / "train" / "b.parquet",
    )
    (raw / "validation" / "c.txt").write_text(texts[30] + texts[31])
    (tmp_path / "loose.txt").write_text(texts[32])
    out = str(tmp_path / "out")
    code = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep.prepare",
            "--input",
            str(raw),
            str(tmp_path / "loose.txt"),
            "--tokenizer",
            "train:300",
            "--out",
            out,
            "--seq_len",
            "16",
            "--domain",
            "Notes",
        ],
        capture_output=True,
        text=True,
    )
    assert code.returncode == 0, code.stderr
    meta = load_metadata(out)
    assert meta["tokenizer"]["spec"] == "train:300" and os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert meta["command"].startswith("python -m data_prep.prepare --input "), meta["command"]
    assert meta["tokenizer"]["vocab_size"] <= 300
    sp = meta["splits"]
    assert sp["train"]["RedPajamaC4"]["documents"] == 20
    assert sp["train"]["RedPajamaBook"]["documents"] == 10
    assert sp["validation"]["Notes"]["documents"] == 1  # .txt in validation/: one document, domain from flag
    assert sp["train"]["Notes"]["documents"] == 1  # loose .txt: default split
    n = sum(len(_tok_ids(out, t)) + 1 for t in texts[:20])
    assert sp["train"]["RedPajamaC4"]["tokens"] == n
    rec = DomainSource(out, meta, "train", "RedPajamaBook")[0]
    assert list(rec) == _tok_ids(out, texts[20])[:17]
    # Budgets stop a domain early; the same command twice writes identical shards.
    out2 = str(tmp_path / "out2")
    prepare([str(raw)], os.path.join(out, "tokenizer.json"), out2, seq_len=16, budgets={"RedPajamaC4": 100}, quiet=True)
    m2 = load_metadata(out2)
    assert 100 <= m2["splits"]["train"]["RedPajamaC4"]["tokens"] < 100 + max(len(_tok_ids(out, t)) + 1 for t in texts)
    out3 = str(tmp_path / "out3")
    prepare([str(raw)], os.path.join(out, "tokenizer.json"), out3, seq_len=16, budgets={"RedPajamaC4": 100}, quiet=True)
    for dom in ("RedPajamaC4", "RedPajamaBook"):
        a = open(os.path.join(out2, "train", dom, "shard-00000.array_record"), "rb").read()
        b = open(os.path.join(out3, "train", dom, "shard-00000.array_record"), "rb").read()
        assert a == b


def test_tfds_source_reads_the_same_records(slimpajama):
    out, _ = slimpajama
    from resformer_jax.data.tfds_source import TfdsDomainSource, build

    build(out)
    meta = load_metadata(out)
    a = DomainSource(out, meta, "validation", "RedPajamaBook")
    b = TfdsDomainSource(out, "validation", "RedPajamaBook")
    assert len(a) == len(b)
    for i in range(0, len(a), 17):
        np.testing.assert_array_equal(a[i], b[i])
    c = tiny_config()
    c.data.source, c.data.path, c.data.seq_len, c.model.vocab_size = "tfds", out, SEQ, 50277
    batch = next(train_iterator(c))
    c.data.source = "array_record"
    np.testing.assert_array_equal(batch, next(train_iterator(c)))
    assert "tensorflow" not in sys.modules or not hasattr(sys.modules["tensorflow"], "constant")


def test_bad_data_stops_with_clear_messages(slimpajama, tmp_path):
    out, _ = slimpajama
    meta = load_metadata(out)
    c = tiny_config()
    c.data.source, c.data.seq_len, c.model.vocab_size = "array_record", SEQ, 50277
    for path, needle in (
        ("", "config.data.path is empty"),
        (str(tmp_path / "nope"), "does not exist"),
        (str(tmp_path), "no metadata.json"),
    ):
        c.data.path = path
        with pytest.raises(DataError, match=needle):
            train_reader(c)
    c.data.path = out
    c.data.mixture = "RedPajamaArXiv=1.0"  # the command-line form
    with pytest.raises(DataError, match="no shards|asks for"):
        train_reader(c)
    with pytest.raises(DataError, match="not below config.model.vocab_size"):
        check_compatible(meta, SEQ, 50000, "", out)
    with pytest.raises(DataError, match="seq_len=128 but config.data.seq_len=256"):
        check_compatible(meta, 256, 50277, "", out)
    with pytest.raises(DataError, match="tokenizer sha256"):
        check_compatible(meta, SEQ, 50277, "0" * 64, out)
    with pytest.raises(PrepareError, match="does not exist"):
        prepare([str(tmp_path / "missing")], "train:300", str(tmp_path / "o"), quiet=True)
    r = run_command(  # `resformer prepare`: the same command by its name (in-process)
        "prepare", "--input", str(tmp_path / "missing"), "--tokenizer", "train:300", "--out", str(tmp_path / "o")
    )
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow  # a run on the NeoX-prepared sample
def test_a_document_masked_run_trains_on_the_corpus_data_prep_wrote_with_the_papers_tokenizer(slimpajama, tmp_path):
    """#74: data.document_mask=True on the corpus `data_prep.prepare` wrote from ../shared/data with the NeoX
    tokenizer (whose end-of-text id, 0, sits in metadata.json's tokenizer block): the run takes that id, trains,
    and its validation loss falls."""
    from resformer_jax.commands.training import run
    from resformer_jax.metrics import read_jsonl

    out, _ = slimpajama
    meta = load_metadata(out)
    c = tiny_config("resformer")
    c.data.source, c.data.path, c.data.seq_len, c.model.max_seq_len = "array_record", out, SEQ, SEQ
    c.model.vocab_size = meta["tokenizer"]["vocab_size"]
    c.data.document_mask = True
    c.train.steps, c.train.eval_every, c.train.log_every, c.train.eval_batches = 16, 16, 8, 1
    c.train.global_batch, c.train.peak_lr, c.train.warmup_steps = 4, 1e-2, 2
    c.mesh.num_devices = 1
    wd = str(tmp_path / "run")
    assert run(c, wd) == 0
    saved = json.load(open(os.path.join(wd, "config.json")))
    assert saved["resolved"]["model.document_eot"] == meta["tokenizer"]["eot_id"] == 0
    losses = read_jsonl(os.path.join(wd, "metrics.jsonl"), "eval/loss")
    assert losses[16] < losses[0] - 0.5, losses
