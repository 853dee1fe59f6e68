"""Start-up as a user meets it: every check that needs only the file system answers before the compile (no
"compiled" line, seconds on the tiny config), Ctrl-C is acknowledged at once and leaves no half-made run directory,
and the goodput ledger's start is the interpreter's, not an exec'ing shell's."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = [sys.executable, "-m", "resformer_jax.main", "--config=configs/tiny.py", "--config.mesh.num_devices=1"]


def train(workdir, *flags, timeout=300):
    t0 = time.perf_counter()
    r = subprocess.run(
        [*TRAIN, f"--workdir={workdir}", *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    return r, time.perf_counter() - t0


def refused_before_compile(r, seconds, cause):
    text = r.stdout + r.stderr
    assert "compiled" not in text and "compiling" not in text, f"the check ran after the compile:\n{text}"
    assert cause in text, text
    assert "Traceback" not in text, text
    assert seconds < 10, f"took {seconds:.1f} s on the tiny config:\n{text}"


def test_a_workdir_that_is_a_file_is_named_before_the_compile(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a run")
    r, s = train(path)
    assert r.returncode == 2
    refused_before_compile(r, s, "is a file, not a directory")
    assert path.read_text() == "not a run"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permissions")
def test_an_unwritable_workdir_is_named_before_the_compile(tmp_path):
    os.chmod(tmp_path, 0o500)
    try:
        r, s = train(tmp_path / "run")
    finally:
        os.chmod(tmp_path, 0o700)
    assert r.returncode == 2
    refused_before_compile(r, s, "is not writable")


def test_deleted_checkpoints_refuse_before_the_compile(tmp_path):
    (tmp_path / "checkpoints_written").write_text("10")  # the marker a run leaves once it saved (rundir.py)
    r, s = train(tmp_path)
    assert r.returncode == 2
    refused_before_compile(r, s, "refusing to start again from step 0")


def test_a_finished_run_says_nothing_to_do_before_the_compile(tmp_path):
    r, _ = train(tmp_path, "--config.train.steps=4", "--config.train.warmup_steps=1")
    assert r.returncode == 0, r.stdout + r.stderr
    r, s = train(tmp_path, "--config.train.steps=4", "--config.train.warmup_steps=1")
    assert r.returncode == 0
    refused_before_compile(r, s, "nothing to do: the run in")
    # the same run resumed with another model: named before the compile
    r, s = train(tmp_path, "--config.train.steps=8", "--config.train.warmup_steps=1", "--config.model.d_model=32")
    assert r.returncode == 2
    refused_before_compile(r, s, "a resumed run cannot change the model")


def test_a_missing_data_path_is_named_before_the_compile(tmp_path):
    r, s = train(tmp_path / "run", "--config.data.source=array_record", f"--config.data.path={tmp_path}/no_such_corpus")
    assert r.returncode == 2
    refused_before_compile(r, s, "no_such_corpus")
    assert not (tmp_path / "run").exists()


def test_ctrl_c_during_the_compile_stops_at_once_and_leaves_nothing(tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [*TRAIN, f"--workdir={workdir}"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "compiling the train step" in line:
            break
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[0]
    waited = time.perf_counter() - sent
    text = "".join(seen) + rest
    assert proc.returncode == 0, text
    assert "stopped during start-up (SIGINT)" in text and "Traceback" not in text, text
    assert "compiled train step" not in text, f"the compile ran on after Ctrl-C:\n{text}"
    assert waited < 5, f"stopped {waited:.1f} s after Ctrl-C"
    assert not workdir.exists(), f"a half-made run directory was left: {list(workdir.rglob('*'))}"


def test_the_goodput_start_is_the_interpreters_not_the_shells(tmp_path):
    """A launcher that prepares something, then execs Python (the same process): the ledger starts at Python."""
    workdir = tmp_path / "run"
    command = " ".join([*TRAIN, f"--workdir={workdir}", "--config.train.steps=4", "--config.train.warmup_steps=1"])
    shell_start = time.time()
    r = subprocess.run(["bash", "-c", f"sleep 3 && exec {command}"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    started = json.loads((workdir / "goodput.json").read_text())["invocations"][0]["started_unix"]
    assert started >= shell_start + 3, f"the ledger starts {started - shell_start:.2f} s after the shell, not >= 3"


def test_the_468m_memory_hint_and_the_start_say_how_long_a_step_would_take_here():
    """#73: the hint that makes the 468M preset fit this CPU also says one of its steps takes hours here, and the
    same estimate (FLOPs a step at the measured peak) is what the start-up warns with."""
    from resformer_jax import perf
    from resformer_jax.config import RunConfig
    from resformer_jax.memory import too_big_for_here
    from resformer_jax.presets import paper_config

    cfg = paper_config("468m")
    cfg.mesh.device_memory_limit_gb = 23.5  # one CPU device with this machine's memory (the suite splits it in 8)
    why = too_big_for_here(cfg, 1)
    assert why and "--config.train.microbatch=" in why and "one step would take at least" in why, why
    floor, how = perf.step_time_floor(RunConfig.of(cfg))
    assert floor > 3600 and "GFLOP a token" in how and perf.say_hours(floor) in why
    cfg.model.dtype = "auto"  # the demo's and most configs' dtype, resolved only later: the estimate takes it too
    assert perf.step_time_floor(RunConfig.of(cfg))[0] > 3600
