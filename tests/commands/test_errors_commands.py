"""Every command's bad input ends in one line: exit code 2, exactly one `error:` line on stderr that names
the input and the fix, no traceback, nothing written where it should not be (a run directory a command only reads
stays byte-identical), and object storage without credentials or network answered in seconds."""

import hashlib
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest
from commands import run_command

from resformer_jax.commands.training import run
from resformer_jax.presets import tiny_config

# end-to-end: runs, commands, processes or compilers; one worker runs this file, so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("errors_commands")]

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two finished tiny runs (vanilla and SVFormer) in one sweep-like folder."""
    root = tmp_path_factory.mktemp("runs")
    for v in ("none", "svformer"):
        c = tiny_config(v)
        c.train.steps, c.train.log_every, c.train.warmup_steps, c.mesh.num_devices = 4, 1, 1, 1
        assert run(c, str(root / v)) == 0
    return root


def _digest(folder: pathlib.Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode() + f.read_bytes())
    return h.hexdigest()


def _here(args):
    """`python -m ARGS` as this process runs it (tests/support/commands.py): the command's status and output."""
    if args[0] == "resformer_jax.main":
        return run_command("train", *args[1:])
    assert args[0] == "resformer_jax", args
    return run_command(args[1], *args[2:])


def _one_line(args, cwd, env=None, bound_s=60, here=False):
    """The one `error:` line of `python -m ARGS` (exit 2, no traceback) within bound_s: in a fresh interpreter, or
    with here=True in this process (the same command and checks, without an interpreter's start)."""
    t = time.perf_counter()
    if here:
        assert cwd == ROOT and env is None, "in-process: the repository's root and this process's environment"
        r = _here(args)
    else:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
        r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    took = time.perf_counter() - t
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, (
        args,
        r.returncode,
        r.stderr[-3000:],
    )
    assert took < bound_s, f"{args}: {took:.1f} s"
    return errors[0]


CASES = [
    # (name, command args with {run}/{runs}/{file}/{other}/{tmp} placeholders, words the line must hold)
    (
        "sweep workdir is a file",
        ["resformer_jax", "sweep", "--config=configs/tiny.py", "--workdir={file}", "--set", "train.seed=0,1"],
        ["is a file", "folder"],
    ),
    (
        "sweep duplicated value",
        [
            "resformer_jax",
            "sweep",
            "--config=configs/tiny.py",
            "--workdir={tmp}/sw",
            "--slurm",
            "--set",
            "train.seed=0,0",
        ],
        ["more than once"],
    ),
    (
        "sweep colliding names",
        [
            "resformer_jax",
            "sweep",
            "--config=configs/tiny.py",
            "--workdir={tmp}/sw",
            "--slurm",
            "--set",
            "data.path=a/b,a-b",
        ],
        ["same run directory"],
    ),
    (
        "sweep value the config rejects",
        [
            "resformer_jax",
            "sweep",
            "--config=configs/tiny.py",
            "--workdir={tmp}/sw",
            "--slurm",
            "--set",
            "model.num_heads=4,5",
        ],
        ["num_heads", "divide"],
    ),
    (
        "compare --out a file",
        ["resformer_jax", "compare", "--baseline", "{run}", "{other}", "--out={file}"],
        ["--out", "is a file"],
    ),
    (
        "compare negative smooth",
        ["resformer_jax", "compare", "--baseline", "{run}", "{other}", "--out={tmp}/c", "--smooth=-5"],
        ["--smooth", "at least 1"],
    ),
    (
        "compare invalid config.json",
        ["resformer_jax", "compare", "{badcfg}", "--group_by", "model.value_residual", "--baseline", "none"],
        ["config.json", "not valid JSON"],
    ),
    (
        "compare empty metrics",
        ["resformer_jax", "compare", "--baseline", "{run}", "{empty}", "--out={tmp}/c"],
        ["no training loss"],
    ),
    (
        "analyze zero sequences",
        ["resformer_jax", "analyze", "--workdir={run}", "--num_sequences=0"],
        ["--num_sequences"],
    ),
    (
        "generate negative tokens",
        ["resformer_jax", "generate", "--workdir={run}", "--prompt_ids=1,2", "--max_new_tokens=-3"],
        ["--max_new_tokens"],
    ),
    (
        "generate id outside vocab",
        ["resformer_jax", "generate", "--workdir={run}", "--prompt_ids=1,256"],
        ["256", "vocabulary"],
    ),
    (
        "generate past the context",
        ["resformer_jax", "generate", "--workdir={run}", "--prompt_ids=1,2", "--max_new_tokens=200"],
        ["= 202 exceeds", "lower --max_new_tokens to 126 or less"],
    ),
    (
        "generate a prompt longer than the context",
        ["resformer_jax", "generate", "--workdir={run}", "--prompt_ids=" + ",".join(["1"] * 130)],
        ["shorten the prompt (130 tokens)"],
    ),
    (
        "generate with a repetition penalty of 0",
        ["resformer_jax", "generate", "--workdir={run}", "--prompt_ids=1,2", "--repetition_penalty=0"],
        ["--repetition_penalty=0.0: must be a number > 0"],
    ),
    (
        "generate on more devices than exist",
        ["resformer_jax", "generate", "--workdir={run}", "--prompt_ids=1,2", "--max_new_tokens=2", "--devices=99"],
        ["--devices=99", "devices"],
    ),
    ("export into another run", ["resformer_jax", "export", "--workdir={run}", "--out={other}"], ["run directory"]),
    ("export into its own run", ["resformer_jax", "export", "--workdir={run}", "--out={run}"], ["run directory"]),
    (
        "export into a non-empty folder",
        ["resformer_jax", "export", "--workdir={run}", "--out={nonempty}"],
        ["not empty"],
    ),
    ("bench attention bad shape", ["resformer_jax", "bench", "attention", "--shapes=1,2,3"], ["--shapes"]),
]


@pytest.mark.parametrize("name,args,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_nothing_is_written(trained, tmp_path, name, args, words):
    runs = tmp_path / "runs"
    shutil.copytree(trained, runs)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "notes.txt").write_text("keep me")
    bad = tmp_path / "bad"
    shutil.copytree(runs / "svformer", bad / "svformer")
    (bad / "svformer" / "config.json").write_text("{bad")
    empty = tmp_path / "empty"
    shutil.copytree(runs / "svformer", empty)
    (empty / "metrics.jsonl").write_text("")
    subs = {
        "{run}": str(runs / "none"),
        "{other}": str(runs / "svformer"),
        "{file}": str(tmp_path / "afile"),
        "{tmp}": str(tmp_path),
        "{badcfg}": str(bad),
        "{empty}": str(empty),
        "{nonempty}": str(tmp_path / "nonempty"),
    }
    args = [a for a in args]
    for i, a in enumerate(args):
        for k, v in subs.items():
            a = a.replace(k, v)
        args[i] = a
    before = _digest(runs)
    line = _one_line(args, cwd=ROOT, here=True)
    for w in words:
        assert w in line, f"{name}: {line!r} lacks {w!r}"
    assert _digest(runs) == before, f"{name} changed a run directory"
    assert not (tmp_path / "sw").exists(), f"{name} wrote a sweep folder"
    assert (tmp_path / "nonempty" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (tmp_path / "nonempty").iterdir()) == ["notes.txt"]


def test_a_reader_of_runs_given_an_export_names_the_commands_that_take_one(trained, tmp_path):
    from resformer_jax.hf.run_export import export_run
    from resformer_jax.load import load_run
    from resformer_jax.rundir import RunDir

    export_run(RunDir(str(trained / "svformer")), load_run(str(trained / "svformer")), str(tmp_path / "hf"))
    for command in (["evaluate"], ["analyze"], ["export", f"--out={tmp_path / 'again'}"]):
        line = _one_line(["resformer_jax", *command, f"--workdir={tmp_path / 'hf'}"], cwd=ROOT)
        assert "`resformer export` wrote, not a run directory" in line and "--hf_model" in line, line
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_partial_last_metrics_line_is_read_without_it(trained, tmp_path):
    """A run training now (or killed mid-write) ends its metrics.jsonl in half a line: compare reads the rest."""
    runs = tmp_path / "runs"
    shutil.copytree(trained, runs)
    with open(runs / "svformer" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train/lo')
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "resformer_jax",
            "compare",
            "--baseline",
            str(runs / "none"),
            str(runs / "svformer"),
            f"--out={tmp_path / 'c'}",
            "--smooth=1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0 and "last line is incomplete" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "final relative train loss" in r.stdout


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_cloud_env(home) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AWS_", "GOOGLE_", "STORAGE_EMULATOR", "CLOUDSDK", "TENSORSTORE_GCS"))
    }
    return {**env, "HOME": str(home), "AWS_EC2_METADATA_DISABLED": "true"}


CLOUD_CASES = [
    ("gs without credentials", "gs://bkt/run", {}, ["no Google Cloud credentials", "GOOGLE_APPLICATION_CREDENTIALS"]),
    ("s3 without credentials", "s3://bkt/run", {}, ["no AWS credentials", "AWS_ACCESS_KEY_ID"]),
    (
        "gs endpoint unreachable",
        "gs://bkt/run",
        {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:{port}"},
        ["cannot reach", "127.0.0.1"],
    ),
    (
        "s3 endpoint unreachable",
        "s3://bkt/run",
        {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": "http://127.0.0.1:{port}"},
        ["cannot reach"],
    ),
    (
        "s3 unknown host",
        "s3://bkt/run",
        {
            "AWS_ACCESS_KEY_ID": "k",
            "AWS_SECRET_ACCESS_KEY": "s",
            "AWS_ENDPOINT_URL": "http://no-such-host.invalid:9000",
        },
        ["cannot resolve"],
    ),
]


@pytest.mark.parametrize("name,workdir,env,words", CLOUD_CASES, ids=[c[0] for c in CLOUD_CASES])
def test_object_storage_without_credentials_or_network_is_one_line_in_seconds(tmp_path, name, workdir, env, words):
    pytest.importorskip(
        "gcsfs" if workdir.startswith("gs") else "s3fs",
        reason="the cloud clients come with the test extra: pip install -e '.[test]'",
    )
    port = _closed_port()
    env = {**_no_cloud_env(tmp_path / "home"), **{k: v.replace("{port}", str(port)) for k, v in env.items()}}
    line = _one_line(
        ["resformer_jax.main", f"--config={ROOT / 'configs' / 'tiny.py'}", f"--workdir={workdir}"],
        cwd=tmp_path,
        env=env,
        bound_s=15,
    )
    for w in words:
        assert w in line, f"{name}: {line!r}"
    assert not list(tmp_path.iterdir()), f"{name}: created {list(tmp_path.iterdir())} locally"


def test_s3_credentials_an_emulator_refuses_are_one_line(tmp_path):
    """moto's server with authentication on (INITIAL_NO_AUTH_ACTION_COUNT=0) refuses unknown keys."""
    pytest.importorskip("moto", reason="the S3 emulator comes with the test extra: pip install -e '.[test]'")
    pytest.importorskip("s3fs", reason="the S3 client comes with the test extra: pip install -e '.[test]'")
    port = _closed_port()
    log = open(tmp_path / "moto.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
    )
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        env = {
            **_no_cloud_env(tmp_path / "home"),
            "AWS_ACCESS_KEY_ID": "wrong",
            "AWS_SECRET_ACCESS_KEY": "wrong",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }
        line = _one_line(
            ["resformer_jax.main", f"--config={ROOT / 'configs' / 'tiny.py'}", "--workdir=s3://bkt/run"],
            cwd=tmp_path,
            env=env,
            bound_s=15,
        )
        assert "refused" in line and "AWS_ACCESS_KEY_ID" in line, line
        assert sorted(p.name for p in tmp_path.iterdir()) == ["moto.log"], "created something locally"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A tiny ResFormer on the demo corpus (it has a tokenizer) with checkpoints at steps 2 and 4."""
    from demo_runs import tokenized_tiny_config

    c = tokenized_tiny_config(steps=4)
    c.train.warmup_steps, c.checkpoint.every_steps = 1, 2
    wd = tmp_path_factory.mktemp("two_checkpoints") / "run"
    assert run(c, str(wd)) == 0
    assert sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    return wd


def _flip_bytes(step_dir: pathlib.Path):
    biggest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0x5A for b in data[mid : mid + 8])
    biggest.write_bytes(bytes(data))


EVAL_SAMPLES = ROOT.parent / "shared" / "data" / "eval_samples"
HARNESS = [
    "resformer_jax",
    "harness",
    "--model",
    "resformer_jax",
    "--tasks",
    "piqa_local",
    "--limit",
    "2",
    "--include_path",
    "configs/lm_eval_tasks",
]
# Every command that reads a run: (name, args with {run}/{tmp}). Against a missing run directory each ends in one
# line; against a run whose newest checkpoint is damaged each uses the newest one that restores, says so and
# names --step, and moves nothing.
READERS = [
    ("generate", ["resformer_jax", "generate", "--workdir={run}", "--prompt_ids=1,2", "--max_new_tokens=2"]),
    ("evaluate validation", ["resformer_jax", "evaluate", "--workdir={run}"]),
    (
        "evaluate zero-shot",
        ["resformer_jax", "evaluate", "--workdir={run}", "--tasks=piqa", f"--task_data={EVAL_SAMPLES}", "--limit=2"],
    ),
    ("analyze", ["resformer_jax", "analyze", "--workdir={run}", "--num_sequences=2", "--out={tmp}/an"]),
    ("export", ["resformer_jax", "export", "--workdir={run}", "--out={tmp}/exported"]),
    ("harness", HARNESS + ["--model_args", "workdir={run}"]),
]


def _sub(args, **kw):
    return [a.format(**kw) for a in args]


@pytest.mark.parametrize("name,args", READERS, ids=[c[0] for c in READERS])
def test_reading_a_missing_run_is_one_line(tmp_path, name, args, shared_data):
    if name == "harness":
        pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (CI installs it)")
    line = _one_line(_sub(args, run=tmp_path / "nope", tmp=tmp_path), cwd=ROOT, here=True)
    assert "does not exist" in line and "nope" in line, line
    assert not (tmp_path / "nope").exists()


OTHER_COMMANDS = [
    (
        "main: workdir under a file",
        ["resformer_jax.main", "--config=configs/tiny.py", "--workdir={tmp}/afile/run"],
        ["afile"],
    ),
    (
        "compare: missing run",
        ["resformer_jax", "compare", "--baseline", "{tmp}/nope", "{tmp}/nope2", "--out={tmp}/c"],
        ["does not exist"],
    ),
    (
        "sweep: missing config",
        ["resformer_jax", "sweep", "--config=configs/nope.py", "--workdir={tmp}/sw", "--set", "train.seed=0,1"],
        ["does not exist"],
    ),
    (
        "compile: missing config",
        ["resformer_jax", "compile", "--config=configs/nope.py", "--target=h100x8"],
        ["does not exist"],
    ),
    ("bench: missing config", ["resformer_jax", "bench", "train", "--config=configs/nope.py"], ["does not exist"]),
    (
        "bench zero_shot: missing tokenizer",
        [
            "resformer_jax",
            "bench",
            "zero_shot",
            "--config=configs/tiny.py",
            "--task_data={tmp}",
            "--tokenizer={tmp}/nope.json",
        ],
        ["--tokenizer", "no such file"],
    ),
    # What absl answers by itself (a flag it cannot parse, a usage error): one line naming it, exit 2, not absl's
    # usage text and exit 1.
    ("bench: no benchmark named", ["resformer_jax", "bench"], ["name a benchmark", "train,attention", "--help"]),
    ("compare: no baseline", ["resformer_jax", "compare", "{tmp}/a"], ["--baseline is required", "compare --help"]),
    ("train: a stray argument", ["resformer_jax.main", "stray"], ["unexpected arguments ['stray']", "train --help"]),
    ("generate: an unknown flag", ["resformer_jax", "generate", "--workdir={tmp}", "--nope=1"], ["'nope'"]),
    ("generate: not a number", ["resformer_jax", "generate", "--workdir={tmp}", "--max_new_tokens=x"], ["=x"]),
    ("export: a required flag missing", ["resformer_jax", "export", "--workdir={tmp}"], ["--out", "export --help"]),
]


@pytest.mark.parametrize("name,args,words", OTHER_COMMANDS, ids=[c[0] for c in OTHER_COMMANDS])
def test_every_other_command_fails_in_one_line(tmp_path, name, args, words):
    (tmp_path / "afile").write_text("x")
    line = _one_line(_sub(args, tmp=tmp_path), cwd=ROOT)
    assert all(w in line for w in words), line


@pytest.mark.parametrize("name,args", READERS, ids=[c[0] for c in READERS])
def test_reading_a_run_whose_newest_checkpoint_is_damaged(two_checkpoints, tmp_path, name, args, shared_data):
    if name == "harness":
        pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (CI installs it)")
    wd = tmp_path / "run"
    shutil.copytree(two_checkpoints, wd)
    _flip_bytes(wd / "checkpoints" / "4")
    before = _digest(wd / "checkpoints")
    r = _here(_sub(args, run=wd, tmp=tmp_path))  # HF_*_OFFLINE: tests/conftest.py
    assert r.returncode == 0 and "Traceback" not in r.stderr, (name, r.stderr[-3000:])
    assert "checkpoint at step 4" in r.stderr and "does not restore" in r.stderr and "--step=2" in r.stderr, r.stderr
    assert _digest(wd / "checkpoints") == before, f"{name} changed the run's checkpoints"
    assert not (wd / "checkpoints_damaged").exists(), f"{name} moved a checkpoint"
    # an explicit --step that is damaged is one line naming the ones that restore
    if name == "generate":
        line = _one_line(_sub(args, run=wd, tmp=tmp_path) + ["--step=4"], cwd=ROOT, here=True)
        assert "step 4" in line and "available: [2]" in line, line


def test_the_headline_config_on_this_host_says_what_it_is_sized_for_before_any_probe():
    """README's headline command with no other flags: sized for 8x H100 and given no data path, both said in one
    line within seconds (no attention probe, no compile at 468M)."""
    line = _one_line(["resformer_jax.main", "--config=configs/resformer_468m.py"], cwd=ROOT, bound_s=30)
    assert "sized for 8x H100 80GB" in line and "config.data.path is empty" in line, line
    assert "--target=h100x8" in line and "--config.train.microbatch=" in line, line
    assert "attention impl" not in line


def test_a_resumed_run_with_another_shape_names_every_differing_field_before_compiling(two_checkpoints, tmp_path):
    wd = tmp_path / "run"
    shutil.copytree(two_checkpoints, wd)
    before = _digest(wd)
    line = _one_line(
        [
            "resformer_jax.main",
            "--config=configs/tiny.py",
            f"--workdir={wd}",
            "--config.data.source=demo",
            "--config.model.vocab_size=1024",
            "--config.data.seq_len=64",
            "--config.model.max_seq_len=256",
            "--config.model.d_model=32",
            "--config.model.ffn_dim=96",
            "--config.model.num_layers=2",
        ],
        cwd=ROOT,
        bound_s=30,
    )
    for field in ("d_model", "ffn_dim", "num_layers"):
        assert f"config.model.{field}" in line, line
    assert "--config.model.d_model=64" in line and "new --workdir" in line, line
    assert _digest(wd) == before


def test_an_export_gets_the_users_umask(two_checkpoints, tmp_path):
    out = tmp_path / "exported"
    r = subprocess.run(
        [
            "bash",
            "-c",
            f"umask 022 && {sys.executable} -m resformer_jax export --workdir={two_checkpoints} --out={out}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    for f in out.iterdir():
        assert oct(f.stat().st_mode & 0o777) == oct(0o644), f


def test_the_aot_extra_keeps_cpu_commands_quiet(tmp_path):
    """With the CUDA plugin and libtpu installed (the aot extra) on a host with neither GPU nor TPU, a command's
    stderr holds its own lines only: no plugin tracebacks, no "could not find cuda drivers"."""
    import importlib.util

    from resformer_jax.runtime import nvidia_driver_present, tpu_chip_present

    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        pytest.skip("the aot extra (CUDA plugin) is not installed: nothing to keep quiet (CI installs it)")
    if nvidia_driver_present() or tpu_chip_present():
        pytest.skip("this host has a GPU or TPU: the plugins' lines are theirs to print")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE")}
    for args in (
        ["resformer_jax.main", "--config=configs/tiny.py", "--mode=summary"],
        ["resformer_jax", "evaluate", f"--workdir={tmp_path / 'nope'}"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
        )
        noise = [ln for ln in r.stderr.splitlines() if any(w in ln for w in ("cuda", "CUDA", "TPU", "Traceback"))]
        assert not noise, (args, r.stderr[-2000:])


def test_compare_cuts_a_smoothing_window_longer_than_the_runs_and_says_so(trained, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "resformer_jax",
            "compare",
            "--baseline",
            str(trained / "none"),
            str(trained / "svformer"),
            f"--out={tmp_path / 'c'}",
            "--smooth=100",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "--smooth=100 is longer than the runs (4 steps logged); smoothing over 4 steps" in r.stderr, r.stderr
