"""Run directories on object storage, against real emulators on the loopback address.

gs:// goes to gcp-storage-emulator (gcsfs and google-cloud-storage follow STORAGE_EMULATOR_HOST, TensorStore's
gcs driver follows TENSORSTORE_GCS_HTTP_URL); s3:// goes to moto's server (s3fs, boto3 and TensorStore's s3 driver
follow AWS_ENDPOINT_URL). Every byte goes through the real client libraries; nothing of the project is mocked.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from commands import run_command

from resformer_jax.presets import tiny_config

# end-to-end: runs, commands, processes or compilers; one worker runs this file, so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cloud")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 12
BUCKET = "runs"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int, proc, what: str, timeout: float = 60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout} s")


def _require(*modules):
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{missing} not installed: pip install -e '.[test]' installs the emulators and clients")


@pytest.fixture(scope="module", params=["gs", "s3"])
def cloud(request, tmp_path_factory):
    """(scheme, env) with an emulator listening; the env is also set in this process while the module runs."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("emulator") / "log.txt", "w")
    if request.param == "gs":
        _require("gcp_storage_emulator", "gcsfs", "google.cloud.storage")
        cmd = [sys.executable, os.path.join(ROOT, "tests", "support", "gcs_emulator.py"), str(port), BUCKET]
        env = {
            "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
            "TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{port}",
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
            "GOOGLE_CLOUD_PROJECT": "test",
            # gcsfs asks the Storage Control API (not emulated) for the bucket type on every call
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }
    else:
        _require("moto", "s3fs", "boto3")
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    saved = {k: os.environ.get(k) for k in env}
    try:
        _wait_for(port, proc, f"the {request.param} emulator")
        os.environ.update(env)
        if request.param == "s3":
            import boto3

            boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield request.param, env
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small prepared corpus on local disk (ArrayRecord reads local files only) and its tokenizer."""
    from resformer_jax.data_prep.prepare import prepare

    d = tmp_path_factory.mktemp("corpus")
    line = "the cat sat on the mat and the dog ate the bone. "
    (d / "raw" / "train").mkdir(parents=True)
    (d / "raw" / "train" / "a.txt").write_text(line * 300)
    (d / "raw" / "validation").mkdir()
    (d / "raw" / "validation" / "b.txt").write_text(line * 40)
    prepare([str(d / "raw")], "train:300", str(d / "data"), seq_len=32, domain="Rep", quiet=True)
    return str(d / "data")


def _cfg(data, steps=STEPS):
    c = tiny_config("resformer")
    c.data.source, c.data.path, c.data.seq_len, c.model.vocab_size = "array_record", data, 32, 300
    c.train.steps, c.train.log_every, c.train.eval_every = steps, 1, 1000
    c.checkpoint.every_steps = 3
    c.mesh.num_devices = 1
    return c


FLAGS = [
    "--config.data.source=array_record",
    "--config.data.seq_len=32",
    "--config.model.vocab_size=300",
    f"--config.train.steps={STEPS}",
    "--config.train.log_every=1",
    "--config.train.eval_every=1000",
    "--config.checkpoint.every_steps=3",
    "--config.mesh.num_devices=1",
    "--config.checkpoint.async_save=True",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """The same run uninterrupted on local disk: storage must not change a bit."""
    from resformer_jax.commands.training import run
    from resformer_jax.metrics import read_jsonl

    wd = str(tmp_path_factory.mktemp("ref"))
    assert run(_cfg(corpus), wd) == 0
    return read_jsonl(os.path.join(wd, "metrics.jsonl"), "train/loss")


def _py(module, *args, env):
    """`resformer COMMAND ARGS` in this process (the `cloud` fixture set the emulator's `env` here too): only the
    killed training run needs a process of its own."""
    assert module == "resformer_jax" and env.items() <= os.environ.items(), (module, env)
    r = run_command(*args)
    assert r.returncode == 0, f"{module} {args}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_cloud_workdir_trains_survives_sigkill_resumes_exactly_and_reads_back(cloud, corpus, reference, capsys):
    from etils import epath

    from resformer_jax.commands.training import run
    from resformer_jax.metrics import read_jsonl
    from resformer_jax.storage import files_under

    scheme, env = cloud
    wd = f"{scheme}://{BUCKET}/exp/run"
    root = epath.Path(wd)

    # Train in a subprocess and SIGKILL it mid-run (asynchronous saves in flight).
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resformer_jax.main",
            "--config=configs/tiny.py",
            f"--workdir={wd}",
            f"--config.data.path={corpus}",
            *FLAGS,
        ],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen, t0 = [], time.time()
    for line in p.stdout:
        seen.append(line)
        if "step       8/" in line:
            break
        assert time.time() - t0 < 300, "".join(seen)
    else:
        raise AssertionError("training ended before step 8:\n" + "".join(seen))
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert (root / "checkpoints").is_dir(), "checkpoints went to the bucket"
    assert not os.path.exists(os.path.join(ROOT, f"{scheme}:")), "a local folder named after the scheme"

    # Resume in this process: bitwise the uninterrupted local run from the step after the checkpoint.
    assert run(_cfg(corpus), wd) == 0
    out = capsys.readouterr().out
    resumed_from = int(out.split("resumed from step ")[1].split(" ")[0])
    assert 3 <= resumed_from <= 8
    losses = read_jsonl(root / "metrics.jsonl", "train/loss")
    for s in range(1, STEPS + 1):
        assert losses[s] == reference[s], f"step {s}: {losses[s]!r} on {scheme}:// != {reference[s]!r} locally"
    # metrics.jsonl on object storage: segments, a new one per process, no line lost before the kill
    assert sorted(p.name for p in (root / "metrics.jsonl.parts").iterdir())[:2] == ["000000.jsonl", "000001.jsonl"]
    for name in ("config.json", "tokenizer.json", "checkpoints_written"):
        assert (root / name).is_file(), name
    assert json.loads((root / "config.json").read_text())["model"]["value_residual"] == "resformer"
    assert any((root / "tb").iterdir()), "TensorBoard events in the bucket"

    # Generation and evaluation read the run back from the bucket; evaluation writes its JSON there.
    r = _py("resformer_jax", "generate", f"--workdir={wd}", "--prompt=the cat sat", "--max_new_tokens=8", env=env)
    assert "the cat sat" in r.stdout
    _py("resformer_jax", "evaluate", f"--workdir={wd}", f"--data={corpus}", env=env)
    ev = json.loads((root / "eval" / f"validation_step{STEPS}.json").read_text())
    assert ev["step"] == STEPS and "Rep" in ev["loss"]

    # A damaged newest checkpoint in the bucket: detected, set aside in the bucket, the previous one used,
    # and the retrained steps are bitwise the same.
    state = root / "checkpoints" / str(STEPS) / "state"
    blobs = [f for f in files_under(state) if "/d/" in str(f)]
    biggest = max(blobs, key=lambda f: len(f.read_bytes()))
    raw = bytearray(biggest.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 8] = bytes(8 - i for i in range(8))
    biggest.write_bytes(bytes(raw))
    assert run(_cfg(corpus), wd) == 0
    cap = capsys.readouterr()
    assert f"checkpoint at step {STEPS}" in cap.err and "does not restore" in cap.err
    assert (root / "checkpoints_damaged" / str(STEPS)).is_dir()
    losses = read_jsonl(root / "metrics.jsonl", "train/loss")
    assert all(losses[s] == reference[s] for s in range(1, STEPS + 1))

    # A bucket run directory that held checkpoints never restarts from zero.
    (root / "checkpoints").rmtree()
    assert run(_cfg(corpus), wd) == 2
    assert "once held checkpoints" in capsys.readouterr().err


def test_metrics_log_on_object_storage_keeps_every_line_in_segments(cloud, monkeypatch):
    from etils import epath

    from resformer_jax import storage
    from resformer_jax.storage import linelog

    scheme, _ = cloud
    monkeypatch.setattr(linelog, "SEGMENT_LINES", 3)
    path = f"{scheme}://{BUCKET}/log/metrics.jsonl"
    first = storage.LineLog(path)
    for i in range(7):
        first.write(json.dumps({"step": i}))
    # a killed process leaves what it flushed; a new one (a resumed run) starts its own segment
    second = storage.LineLog(path)
    for i in range(7, 9):
        second.write(json.dumps({"step": i}))
    second.close()
    assert [json.loads(ln)["step"] for ln in storage.read_lines(path)] == list(range(9))
    parts = sorted(p.name for p in epath.Path(f"{scheme}://{BUCKET}/log/metrics.jsonl.parts").iterdir())
    assert parts == ["000000.jsonl", "000001.jsonl", "000002.jsonl", "000003.jsonl"]


# The commands below use the same epath code for both schemes; the s3:// run is covered by the tests above.
@pytest.mark.parametrize("cloud", ["gs"], indirect=True)
def test_cloud_outputs_of_analyze_compare_export_and_prepare(cloud, corpus, tmp_path, capsys):
    from etils import epath

    from resformer_jax.commands.training import run

    _scheme, env = cloud
    wd = f"gs://{BUCKET}/exp/short"
    assert run(_cfg(corpus, steps=6), wd) == 0
    _py("resformer_jax", "analyze", f"--workdir={wd}", f"--data={corpus}", "--num_sequences=4", env=env)
    an = epath.Path(wd) / "analysis"
    assert json.loads((an / "analysis.json").read_text())[0]["step"] == 6
    assert (an / "entropy.png").read_bytes()[:4] == b"\x89PNG"
    _py("resformer_jax", "compare", "--baseline", wd, wd, "--smooth=2", f"--out={wd}/cmp", env=env)
    rel = json.loads((epath.Path(wd) / "cmp" / "relative_train_loss.json").read_text())
    assert max(abs(x) for x in rel["short"]["relative"]) == 0.0
    _py("resformer_jax", "export", f"--workdir={wd}", f"--out={wd}/hf", env=env)
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in (epath.Path(wd) / "hf").iterdir()}
    gen = ["generate", "--prompt=one two three", "--max_new_tokens=6"]  # the export read back from the bucket
    assert _py("resformer_jax", *gen, f"--workdir={wd}/hf", env=env).stdout == (
        _py("resformer_jax", *gen, f"--workdir={wd}", env=env).stdout
    )

    # Prepared corpora: written straight to the bucket (metadata last); training from it says how to read it.
    from resformer_jax.data_prep.prepare import prepare

    raw = tmp_path / "raw" / "train"
    raw.mkdir(parents=True)
    (raw / "a.txt").write_text("one two three four five six seven eight nine ten. " * 200)
    prepare([str(tmp_path / "raw")], "train:300", f"gs://{BUCKET}/corpus", seq_len=32, domain="D", quiet=True)
    meta = json.loads(epath.Path(f"gs://{BUCKET}/corpus/metadata.json").read_text())
    shard = meta["splits"]["train"]["D"]["shards"][0]
    assert epath.Path(f"gs://{BUCKET}/corpus/train/D/{shard}").is_file()
    c = _cfg(f"gs://{BUCKET}/corpus")
    assert run(c, str(tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "ArrayRecord cannot read" in err and "gcsfuse" in err and "config.data.path" in err


def test_missing_cloud_package_is_one_message_naming_the_extra(tmp_path, monkeypatch, capsys):
    from resformer_jax.commands.training import run

    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed
    assert run(tiny_config("resformer"), "gs://bucket/run") == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "gcsfs" in err and "pip install -e '.[gcs]'" in err, err
    assert "Traceback" not in err
    assert not os.path.exists(os.path.join(ROOT, "gs:")) and not os.path.exists("gs:")
