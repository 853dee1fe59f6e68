"""Corpus preparation as an Apache Beam pipeline: the same output as the threaded path."""

import os
import sys

import numpy as np
import pytest
from corpus_sample import trimmed_slimpajama

from resformer_jax.data.records import DomainSource, load_metadata
from resformer_jax.data_prep.prepare import PrepareError, prepare

# end-to-end: runs, commands, processes or compilers; one worker runs this file, so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("beam")]

SEQ = 128
MULTIPROCESS = "--runner=DirectRunner --direct_num_workers=2 --direct_running_mode=multi_processing"


def _beam_or_skip():
    try:
        import apache_beam  # noqa: F401
    except ImportError:
        pytest.skip("Apache Beam is not installed here (pip install -e '.[beam]'; CI installs it)")


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    from conftest import SHARED_DATA

    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent: these tests need ../shared/data beside the checkout")
    _beam_or_skip()
    root = tmp_path_factory.mktemp("beam")
    # every domain and split of the sample, fewer and shorter documents: the runners' equality is the point, not size
    sample = trimmed_slimpajama(SHARED_DATA, root / "sample", docs_per_domain=8, chars_per_doc=4000)
    args = ([str(sample)], str(SHARED_DATA / "tokenizers" / "gpt-neox-20b.json"))
    prepare(*args, str(root / "threads"), seq_len=SEQ, quiet=True, shuffle_docs=True, seed=3)
    prepare(
        *args,
        str(root / "beam"),
        seq_len=SEQ,
        quiet=True,
        shuffle_docs=True,
        seed=3,
        runner="beam",
        beam_options=MULTIPROCESS,
    )
    prepare(
        *args,
        str(root / "beam_file"),
        seq_len=SEQ,
        quiet=True,
        runner="beam",
        beam_packing="file",
        beam_options="--runner=DirectRunner",
    )
    prepare(*args, str(root / "threads_plain"), seq_len=SEQ, quiet=True)
    return root


def records(path, meta, split, dom):
    src = DomainSource(str(path), meta, split, dom)
    return [src[i] for i in range(len(src))]


def test_beam_multiprocess_equals_threaded_records_and_counts(both):
    from tokenizers import Tokenizer

    a, b = load_metadata(str(both / "threads")), load_metadata(str(both / "beam"))
    assert b["runner"] == "beam" and b["packing"] == "domain" and a["runner"] == "threads"
    tok = Tokenizer.from_file(str(both / "beam" / "tokenizer.json"))
    checked = 0
    for split in ("train", "validation"):
        assert sorted(a["splits"][split]) == sorted(b["splits"][split])
        for dom, st in a["splits"][split].items():
            for key in ("documents", "tokens", "sequences", "tokens_dropped"):
                assert b["splits"][split][dom][key] == st[key], (split, dom, key)
            if not st["sequences"]:
                continue
            ra, rb = records(both / "threads", a, split, dom), records(both / "beam", b, split, dom)
            assert len(ra) == len(rb) == st["sequences"]
            for x, y in zip(ra, rb):
                np.testing.assert_array_equal(x, y)
            assert tok.decode(list(rb[0])) == tok.decode(list(ra[0]))
            checked += 1
    assert checked >= 7


def test_beam_file_packing_keeps_documents_and_tokens(both):
    a, b = load_metadata(str(both / "threads_plain")), load_metadata(str(both / "beam_file"))
    assert b["packing"] == "file"
    for split, doms in a["splits"].items():
        for dom, st in doms.items():
            assert (b["splits"][split][dom]["documents"], b["splits"][split][dom]["tokens"]) == (
                st["documents"],
                st["tokens"],
            )
            assert b["splits"][split][dom]["sequences"] <= st["sequences"]  # a partial record per file is dropped


def test_training_reads_the_beam_corpus(both, tmp_path):
    from resformer_jax.commands.training import run
    from resformer_jax.presets import tiny_config

    c = tiny_config("resformer")
    c.data.source, c.data.path, c.data.seq_len = "array_record", str(both / "beam"), SEQ
    c.model.vocab_size, c.model.max_seq_len = 50432, SEQ
    c.train.steps, c.train.global_batch, c.train.eval_every, c.mesh.num_devices = 3, 4, 3, 1
    assert run(c, str(tmp_path)) == 0


def test_runner_beam_without_beam_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "apache_beam", None)
    with pytest.raises(PrepareError, match=r"pip install -e '\.\[beam\]'"):
        prepare([str(tmp_path)], "train:300", str(tmp_path / "o"), runner="beam", quiet=True)
    assert not os.path.exists(tmp_path / "o")


def test_ranged_reads_of_a_large_jsonl_yield_every_document_once_in_order(tmp_path, monkeypatch):
    """Large .jsonl files are read in byte ranges by several workers: each line belongs to the range it starts in."""
    import json

    from resformer_jax.data_prep import beam_pipeline
    from resformer_jax.data_prep.prepare import read_documents

    path = tmp_path / "big.jsonl"
    docs = [{"text": f"doc {i} " + "x" * (i * 7 % 50), "meta": {"redpajama_set_name": "D"}} for i in range(200)]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    monkeypatch.setattr(beam_pipeline, "SPLIT_BYTES", 333)  # many ranges, boundaries inside lines
    units = beam_pipeline.work_units([str(path)])
    assert len(units) > 10
    got = [kv for u in units for kv in beam_pipeline.read_unit(u, "default", "train", 0, False, False)]
    assert [text for _, (_, _, text) in got] == [t for _, t in read_documents(str(path), "default")]
    positions = [pos for _, (_, pos, _) in got]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
