"""A mistake in a config, a corpus, its preparation or a training run ends in one line on stderr, a non-zero
exit, no traceback, nothing damaged; truncated inputs are errors; an interrupted re-preparation leaves a
consistent folder."""

import json
import os
import resource
import signal
import subprocess
import sys

import pytest

# one worker runs this file, so its module fixtures are built once
pytestmark = pytest.mark.xdist_group("errors_training_and_data")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cmd(*args, timeout=300, **kw):
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw
    )


def assert_one_line(r, *needles, code=2):
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])


def docs(n, tag="", domain="RedPajamaC4"):
    return "".join(
        json.dumps(
            {
                "text": f"document {i} {tag} " + "lorem ipsum dolor sit amet " * 20,
                "meta": {"redpajama_set_name": domain},
            }
        )
        + "\n"
        for i in range(n)
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small prepared corpus (train + validation) from generated text."""
    root = tmp_path_factory.mktemp("corpus")
    for split in ("train", "validation"):
        (root / "raw" / split).mkdir(parents=True)
        (root / "raw" / split / "a.jsonl").write_text(docs(60, split))
    r = cmd(
        "data_prep.prepare",
        "--input",
        str(root / "raw"),
        "--tokenizer",
        "train:300",
        "--out",
        str(root / "out"),
        "--seq_len",
        "32",
    )
    assert r.returncode == 0, r.stderr
    return root


TRAIN = ["resformer_jax.main", "--config=configs/tiny.py", "--config.mesh.num_devices=1", "--config.train.steps=4"]


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--config=configs/tiny.py", "--config.model.d_modle=64"], ["d_modle", "did you mean d_model"]),
        (["--config=configs/no_such_file.py"], ["no_such_file.py", "does not exist"]),
        (["--config=configs/tiny.py", "--config.train.steps=many"], ["train.steps", "integer"]),
    ],
    ids=["typo", "missing-config", "bad-type"],
)
def test_config_flag_mistakes(args, needles, tmp_path):
    assert_one_line(cmd("resformer_jax.main", *args, f"--workdir={tmp_path / 'w'}"), *needles)
    assert not (tmp_path / "w").exists()


def test_broken_config_files(tmp_path):
    bad = tmp_path / "syntax.py"
    bad.write_text("def get_config(:\n    pass\n")
    assert_one_line(cmd("resformer_jax.main", f"--config={bad}", "--mode=summary"), "syntax error at line 1")
    none = tmp_path / "none.py"
    none.write_text("x = 1\n")
    assert_one_line(cmd("resformer_jax.main", f"--config={none}", "--mode=summary"), "no get_config()")


@pytest.mark.slow
def test_mixture_from_the_command_line(corpus, tmp_path):
    data = str(corpus / "out")
    base = [
        *TRAIN,
        f"--workdir={tmp_path / 'w'}",
        "--config.data.source=array_record",
        f"--config.data.path={data}",
        "--config.data.seq_len=32",
        "--config.model.vocab_size=512",
    ]
    assert_one_line(cmd(*base, "--config.data.mixture=RedPajamaGithub=1.0"), "mixture asks for", "RedPajamaC4")
    assert_one_line(cmd(*base, "--config.data.mixture=RedPajamaC4"), "is not DOMAIN=WEIGHT")
    r = cmd(*base, "--config.data.mixture=RedPajamaC4=0.3")
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow  # over 12 s in the fast tier
def test_damaged_prepared_data(corpus, tmp_path):
    import shutil

    base = [*TRAIN, "--config.data.source=array_record", "--config.data.seq_len=32", "--config.model.vocab_size=512"]
    bad_json = tmp_path / "bad_json"
    shutil.copytree(corpus / "out", bad_json)
    (bad_json / "metadata.json").write_text('{"format": "resformer_jax.packed.v1", "seq_')
    assert_one_line(
        cmd(*base, f"--config.data.path={bad_json}", f"--workdir={tmp_path / 'w1'}"),
        "metadata.json is not valid JSON",
        "prepare it again",
    )
    incomplete = tmp_path / "incomplete"
    shutil.copytree(corpus / "out", incomplete)
    (incomplete / "metadata.json").write_text('{"format": "resformer_jax.packed.v1", "seq_len": 32}')
    assert_one_line(cmd(*base, f"--config.data.path={incomplete}", f"--workdir={tmp_path / 'w2'}"), "is incomplete")
    truncated = tmp_path / "truncated"
    shutil.copytree(corpus / "out", truncated)
    shard = truncated / "train" / "RedPajamaC4" / "shard-00000.array_record"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    assert_one_line(
        cmd(*base, f"--config.data.path={truncated}", f"--workdir={tmp_path / 'w3'}"),
        "RedPajamaC4",
        "prepare the data again",
    )


def test_prepare_input_mistakes_name_the_file_and_line(tmp_path):
    def prep(inp, *extra):
        return cmd(
            "data_prep.prepare",
            "--input",
            str(inp),
            "--tokenizer",
            "train:300",
            "--out",
            str(tmp_path / "out"),
            "--seq_len",
            "32",
            *extra,
        )

    garbage = tmp_path / "g" / "x.jsonl.zst"
    garbage.parent.mkdir()
    garbage.write_bytes(b"this is not zstd at all" * 10)
    assert_one_line(prep(garbage), str(garbage), "not a valid zstd file")
    no_text = tmp_path / "t" / "x.jsonl"
    no_text.parent.mkdir()
    no_text.write_text(docs(3) + json.dumps({"content": "hi"}) + "\n")
    assert_one_line(prep(no_text), f"{no_text}:4", '"text"')
    broken = tmp_path / "b" / "x.jsonl"
    broken.parent.mkdir()
    broken.write_text(docs(2) + '{"text": "unterminated\n')
    assert_one_line(prep(broken), f"{broken}:3", "not a JSON line")
    latin = tmp_path / "l" / "x.jsonl"
    latin.parent.mkdir()
    latin.write_bytes(docs(2).encode() + b'{"text": "caf\xe9"}\n')
    assert_one_line(prep(latin), f"{latin}:3", "not UTF-8")
    assert_one_line(prep(no_text.parent, "--budget", "RedPajamaC4=lots"), "--budget", "RedPajamaC4=lots")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    r = cmd("data_prep.prepare", "--input", str(broken.parent), "--tokenizer", "train:300", "--out", str(a_file))
    assert_one_line(r, "is an existing file")
    assert a_file.read_text() == "x"
    assert not (tmp_path / "out").exists(), "a failed preparation leaves no output folder"
    # a mistyped tokenizer path says the file is missing, not the Hugging Face Hub's rules for repo ids
    r = cmd(
        "data_prep.prepare",
        "--input",
        str(broken.parent),
        "--tokenizer",
        str(tmp_path / "tok.json"),
        "--out",
        str(tmp_path / "o"),
    )
    assert_one_line(r, "no such file", "tok.json")


def test_truncated_zst_is_an_error_or_a_counted_skip(tmp_path):
    import zstandard

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "good.jsonl").write_text(docs(40))
    data = zstandard.ZstdCompressor().compress(docs(40, "zst").encode())
    (raw / "cut.jsonl.zst").write_bytes(data[: len(data) * 2 // 3])
    args = [
        "data_prep.prepare",
        "--input",
        str(raw),
        "--tokenizer",
        "train:300",
        "--out",
        str(tmp_path / "o"),
        "--seq_len",
        "32",
    ]
    assert_one_line(cmd(*args), "cut.jsonl.zst", "truncated")
    assert not (tmp_path / "o").exists()
    r = cmd(*args, "--skip_bad_files")
    assert r.returncode == 0 and "skipping a bad input file" in r.stderr, r.stderr
    meta = json.load(open(tmp_path / "o" / "metadata.json"))
    assert [s["file"] for s in meta["skipped_files"]] == [str(raw / "cut.jsonl.zst")]
    assert "truncated" in meta["skipped_files"][0]["reason"]


def test_killed_re_preparation_leaves_a_consistent_folder(corpus, tmp_path):
    import shutil

    from resformer_jax.data.records import DomainSource, load_metadata

    out = tmp_path / "out"
    shutil.copytree(corpus / "out", out)
    before = load_metadata(str(out))
    big = tmp_path / "big"
    big.mkdir()
    for i in range(6):
        (big / f"part{i}.jsonl").write_text(docs(400, f"new{i}"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "data_prep.prepare",
            "--input",
            str(big),
            "--tokenizer",
            "train:300",
            "--out",
            str(out),
            "--seq_len",
            "32",
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:
        if "[prepare] 1/6 files" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=120)
    meta = load_metadata(str(out))  # still the old, complete corpus
    assert meta == before
    for split, doms in meta["splits"].items():
        for dom, st in doms.items():
            if st.get("sequences"):
                DomainSource(str(out), meta, split, dom)  # every shard opens with the listed record count
    assert not any(
        p.name.startswith("out.") and (p / "metadata.json").exists() for p in tmp_path.iterdir() if p.is_dir()
    ), "no half-written folder looks complete"


def test_bench_attention_malformed_shapes():
    assert_one_line(cmd("resformer_jax", "bench", "attention", "--shapes=4,2048,16"), "--shapes", "B,T,H,K,D")


@pytest.mark.slow
def test_a_step_that_cannot_fit_in_host_memory_stops_before_running(tmp_path):
    """A batch far beyond this host's RAM: XLA:CPU reports no memory limit, so without a check the step would
    start and die inside the runtime ("Out of memory allocating ..."). Training and the benchmark both stop
    first, naming the size and the fix; nothing is created in the workdir."""
    huge = ["--config.train.global_batch=1048576", "--config.mesh.num_devices=1"]
    r = cmd("resformer_jax", "bench", "train", "--config=configs/demo.py", "--steps=1", *huge)
    assert_one_line(r, "the train step needs", "this host's memory", "config.train.global_batch")
    r = cmd(
        "resformer_jax.main", "--config=configs/tiny.py", "--config.train.steps=4", *huge, f"--workdir={tmp_path / 'w'}"
    )
    assert_one_line(r, "the train step needs", "config.train.global_batch")
    assert not (tmp_path / "w").exists(), os.listdir(tmp_path / "w")  # checked before anything is written


@pytest.mark.slow  # trains: 5-6 s cold on 2 cores
def test_read_only_workdir(tmp_path):
    r = cmd(*TRAIN, "--workdir=/sys/kernel/resformer_run")
    assert_one_line(r, "/sys/kernel")


@pytest.mark.slow
def test_disk_full_while_saving(tmp_path):
    """The file-size limit stands in for a full disk: the checkpoint's array files cannot be written."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR="")  # compiled programs are larger than the limit
    r = cmd(*TRAIN, f"--workdir={tmp_path / 'w'}", "--config.checkpoint.every_steps=2", preexec_fn=limit, env=env)
    assert_one_line(r, "could not write the checkpoint", "File too large")


def test_memory_advice_leaves_out_knobs_already_at_their_limit():
    from resformer_jax.memory import memory_knobs
    from resformer_jax.presets import tiny_config

    c = tiny_config("resformer")
    c.train.global_batch, c.train.microbatch, c.model.remat, c.mesh.fsdp = 8, 0, "none", 1
    advice = memory_knobs(c, 2)
    assert "microbatch" in advice and "remat=full" in advice and "config.mesh.fsdp" in advice
    c.model.remat, c.train.microbatch, c.mesh.fsdp = "full", 2, -1
    assert memory_knobs(c, 2).startswith("it does not fit even with one sequence a device"), memory_knobs(c, 2)
    c.train.microbatch = 4
    advice = memory_knobs(c, 2)
    assert "microbatch" in advice and "remat" not in advice and "fsdp" not in advice, advice


def test_the_sized_for_check_takes_a_config_whose_dtype_is_auto():
    """The demo's model.dtype=auto is resolved after the start-up checks: the memory estimate works without it."""
    from resformer_jax.commands.common import load_config_file
    from resformer_jax.memory import too_big_for_here

    demo = load_config_file(os.path.join(ROOT, "configs", "demo.py"))
    assert demo.model.dtype == "auto"
    assert too_big_for_here(demo, 1) is None
    demo.mesh.device_memory_limit_gb = 1e-6
    assert "per device by the analytic estimate" in too_big_for_here(demo, 1)
    assert demo.model.dtype == "auto"  # the user's config is not changed
