"""A stalled run says so (train/watchdog.py) and where the time went (train/goodput.py): the budgets, the stack
file, the exit status, the launcher's line, resuming after a stall, and the ledger across restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from commands import multiprocess_env, run_command

from resformer_jax.errors import EXIT_STALLED
from resformer_jax.train import goodput
from resformer_jax.train.faults import Faults
from resformer_jax.train.watchdog import Budgets, Watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_budgets_follow_the_phase_and_the_median_log_window():
    wd = Watchdog(Budgets(startup_s=50, compile_s=100, step_factor=3, min_step_s=10, eval_s=70, checkpoint_s=40), "x")
    assert wd.budget("start-up") == 50 and wd.budget("compile") == 100 and wd.budget("evaluation") == 70
    assert wd.budget("checkpoint save") == 40 and wd.budget("restore") == 40 and wd.budget("finish") == 40
    assert wd.budget("step") == 100 == wd.budget("data")  # no window timed yet: the first steps get the compile's
    for w in (2.0, 4.0, 100.0):
        wd.window(w)
    assert wd.budget("step") == 12.0  # 3 x the median window (4 s), not the one slow window
    wd.window(1.0)
    wd.window(1.0)
    assert wd.budget("data") == 10.0  # never below min_step_s
    wd.enter("data", 7)
    t0 = time.monotonic()
    assert wd.overdue(now=t0 + 9) is None
    phase, step, age, budget, _ = wd.overdue(now=t0 + 11)
    assert (phase, step, budget) == ("data", 7, 10.0) and age > 10
    wd.progress(8)  # a finished step restarts the phase's clock
    assert wd.overdue(now=time.monotonic() + 9) is None

    # Of two processes, the one waiting inside a step outlasts the one stuck reading data by three polls.
    peer = Watchdog(Budgets(step_factor=3, min_step_s=10, poll_s=1.0), "x", process_index=0, process_count=2)
    peer.window(1.0)
    assert peer.budget("data") == 10.0 and peer.budget("step") == 13.0


def test_injected_faults_name_the_step_and_process():
    assert Faults.from_env(0, {}) == Faults()
    assert Faults.from_env(1, {"RESFORMER_TEST_BLOCK_DATA": "15:1"}).block_at == 15
    assert Faults.from_env(0, {"RESFORMER_TEST_BLOCK_DATA": "15:1"}).block_at is None
    f = Faults.from_env(3, {"RESFORMER_TEST_BLOCK_DATA": "9::2.5", "RESFORMER_TEST_NOISE_BATCH": "4,7"})
    assert (f.block_at, f.block_s, f.noise_at) == (9, 2.5, {4, 7})
    batch = np.arange(12, dtype=np.int32).reshape(2, 6)
    assert f.batch(5, batch, 50) is batch
    noise = f.batch(4, batch, 50)
    assert noise.shape == batch.shape and noise.dtype == batch.dtype and (noise != batch).any()
    assert (noise == f.batch(4, batch, 50)).all() and noise.max() < 50  # the same noise on a rerun


def test_fire_writes_every_threads_stack_runs_callbacks_then_exits_with_its_status(tmp_path, capsys):
    release = threading.Event()

    def a_read_hung_on_a_network_filesystem():
        release.wait(30)

    t = threading.Thread(target=a_read_hung_on_a_network_filesystem, daemon=True)
    t.start()
    stalls, exits = [], []
    stack_file = tmp_path / "run" / "watchdog" / "process_1.txt"
    wd = Watchdog(Budgets(), stack_file, process_index=1, process_count=2)
    wd.on_stall.append(lambda phase, s: stalls.append((phase, round(s))))
    try:
        wd.fire("step", 31, 62.0, 60.0, 1700000000.0, exit=exits.append)
    finally:
        release.set()
    text = stack_file.read_text()
    assert text.splitlines()[0] == (
        "watchdog: process=1 phase=step step=31 stalled_s=62.0 budget_s=60.0 since_unix=1700000000.000"
    )
    assert "a_read_hung_on_a_network_filesystem" in text  # the blocked frame, with the others
    assert stalls == [("step", 62)] and exits == [EXIT_STALLED]
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: watchdog: process 1 made no progress for 62 s in phase 'step' (step 31")
    assert "collective waiting on another process" in err[-1] and str(stack_file) in err[-1]


def test_ledger_categories_add_up_to_the_wall_and_resumes_count_recomputed_steps(tmp_path):
    path = tmp_path / "goodput.json"
    first = goodput.Ledger(path, started_unix=time.time() - 2.0)  # 2 s of imports before the ledger existed
    first.start_writing()
    first.resumed_at(0)
    for category, seconds in (("compile", 0.05), ("steps", 0.1), ("checkpoint", 0.02), ("steps", 0.1)):
        first.switch(category)
        time.sleep(seconds)
    first.finished_step(29)
    first.finished_step(30)  # each step written at once: a SIGKILL between log steps still leaves step 30 (#73)
    assert goodput.read(path)[0]["last_step"] == 30
    first.write()  # written at a log step, then the process is killed: the record stays "open"
    rec = goodput.read(path)[0]
    assert rec["end"] == "open" and abs(sum(rec["seconds"].values()) - rec["wall_s"]) < 1e-2
    assert rec["seconds"]["startup"] >= 2.0 and rec["seconds"]["steps"] >= 0.2

    second = goodput.Ledger(path)
    second.start_writing()
    assert second.earlier[0]["end"] == "unknown"  # it ended without a word
    second.resumed_at(20)  # the checkpoint at 20: steps 21-30 are done again
    assert second.recomputed_steps == 10
    assert abs(second.recomputed_s - 10 * rec["seconds"]["steps"] / 30) < 1e-6
    second.switch("steps")
    time.sleep(0.05)
    second.stalled("data", 0.02)  # the watchdog's time leaves the category it was charged to
    t = second.write(end="finished")
    assert t["invocations"] == 2 and t["unknown"] == 1
    assert abs(sum(t["seconds"].values()) - t["wall_s"]) < 2e-2
    assert t["productive_s"] == pytest.approx(t["seconds"]["steps"] - t["recomputed_s"])
    assert t["goodput"] == pytest.approx(t["productive_s"] / t["wall_s"])
    assert t["seconds"]["stalled"] == pytest.approx(0.02)
    assert "goodput" in goodput.describe(t) and "recomputed steps" in goodput.describe(t)


def _train(wd, *flags, env=None, timeout=300):
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "resformer_jax.main", "--config=configs/tiny.py", f"--workdir={wd}", *flags],
        cwd=ROOT,
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r, time.time() - t0


@pytest.mark.slow
def test_a_blocked_data_read_is_named_with_its_stack_and_the_rerun_resumes_to_the_same_losses(tmp_path):
    """One process whose data read blocks at step 25 (after the checkpoint at 20): the watchdog's stack file shows
    the blocked frame, the exit status is 5, the last line says which phase stalled, the checkpoints are intact,
    and the rerun resumes from 20 to the losses of a run never interrupted with the watchdog off, bitwise: the
    watchdog, with tight budgets across both invocations' compiles, evaluations and saves, changes nothing. The
    ledger's parts add up to each invocation's wall time, which matches the process's own within 2%; the recomputed
    steps are counted; goodput goes to TensorBoard's scalars (metrics.jsonl mirrors them)."""
    from resformer_jax.metrics import read_jsonl

    flags = [
        "--config.train.steps=40",
        "--config.checkpoint.every_steps=10",
        "--config.train.log_every=5",
        "--config.train.eval_every=10",
    ]
    tight = ["--config.watchdog.min_step_s=4", "--config.watchdog.step_factor=2"]
    stalled = str(tmp_path / "stalled")
    r, wall1 = _train(stalled, *flags, *tight, env={"RESFORMER_TEST_BLOCK_DATA": "25"})
    assert r.returncode == EXIT_STALLED, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: watchdog: process 0 made no progress for") and "phase 'data' (step 25" in last
    stacks = open(os.path.join(stalled, "watchdog", "process_0.txt")).read()
    assert "in _blocked_read" in stacks and "in before_read" in stacks and "in _next_batch" in stacks, stacks[-2000:]
    assert sorted(os.listdir(os.path.join(stalled, "checkpoints"))) == ["10", "20"]

    r, wall2 = _train(stalled, *flags, *tight)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 20" in r.stdout + r.stderr
    off = str(tmp_path / "off")
    # the reference run in-process (the same compiled code as the subprocesses: tests/conftest.py)
    off_flags = [*flags, "--config.watchdog.enabled=False"]
    ref = run_command("train", "--config=configs/tiny.py", f"--workdir={off}", *off_flags)
    assert ref.returncode == 0, ref.stderr[-2000:]
    losses = {d: read_jsonl(os.path.join(d, "metrics.jsonl"), "train/loss") for d in (stalled, off)}
    # bitwise: the watchdog (tight budgets in both invocations) changes nothing it watches, and the resume is exact
    assert sorted(losses[stalled]) == sorted(losses[off]) == list(range(5, 41, 5))
    assert [losses[stalled][s] for s in range(5, 41, 5)] == [losses[off][s] for s in range(5, 41, 5)]

    invocations = json.loads(open(os.path.join(stalled, "goodput.json")).read())["invocations"]
    assert len(invocations) == 2
    for inv, wall in zip(invocations, (wall1, wall2)):
        assert abs(sum(inv["seconds"].values()) - inv["wall_s"]) < 0.01
        # The ledger's wall is the process's from its start to the end of training: all but the interpreter's
        # teardown after the last record (about 0.4 s here, whatever the run's length; 1.9 s once on a host busy
        # with compiles besides the suite).
        assert -0.3 <= wall - inv["wall_s"] <= 0.03 * wall + 2.0, (inv["wall_s"], wall)
    assert invocations[0]["seconds"]["stalled"] >= 4 and invocations[0]["end"] == "stalled"
    assert invocations[1]["recomputed_steps"] == 4 and invocations[1]["end"] == "finished"  # 21-24 ran twice
    scalars = read_jsonl(os.path.join(stalled, "metrics.jsonl"), "goodput/goodput")
    assert scalars and all(0 < v < 1 for v in scalars.values())
    assert "goodput" in r.stdout + r.stderr  # printed at the end
    table = run_command("compare", "--goodput", stalled)
    assert table.returncode == 0 and "stalled" in table.stdout.splitlines()[0], table.stderr[-2000:]
    row = table.stdout.splitlines()[1]
    assert row.startswith("stalled") and row.endswith("(2 invocation(s))"), row  # the stall said so: not unknown


@pytest.mark.slow  # two processes launched twice, and a reference run
def test_a_stalled_process_of_two_is_named_by_the_launcher_and_the_rerun_resumes(tmp_path):
    """2 processes x 2 CPU devices; process 1's main thread blocks reading step 15's data (after the checkpoint at
    10) while its other threads, JAX's heartbeats among them, run on. Both processes end within the budget plus a
    margin, each with the watchdog's line or a collective failure's; the launcher's last line names process 1 as
    stalled; the rerun resumes to the losses of a run never interrupted, process 0's saved data position damaged
    before it (read by that process alone: it is positioned from the step number, and the other process, which read
    its own, must not wait for it inside Orbax's barrier: that rerun had hung)."""
    from resformer_jax.metrics import read_jsonl

    steps, every = 30, 10
    flags = [
        "--config.model.num_kv_heads=2",
        f"--config.train.steps={steps}",
        "--config.train.log_every=1",
        "--config.train.eval_every=1000",
        f"--config.checkpoint.every_steps={every}",
        "--config.distributed.heartbeat_timeout_s=10",
        "--config.watchdog.min_step_s=5",
        "--config.watchdog.step_factor=2",
    ]
    wd = str(tmp_path / "mp")
    env = multiprocess_env(2)
    cmd = ["bash", os.path.join(ROOT, "launch", "local_multiprocess.sh"), "2", "configs/tiny.py", wd, *flags]
    t0 = time.time()
    r = subprocess.run(
        cmd, cwd=ROOT, env=dict(env, RESFORMER_TEST_BLOCK_DATA="15:1"), capture_output=True, text=True, timeout=400
    )
    assert r.returncode != 0, r.stderr[-3000:]
    logs = [open(os.path.join(wd, "logs", f"process_{i}.log")).read() for i in (0, 1)]
    assert "error: watchdog: process 1 made no progress" in logs[1] and "phase 'data' (step 15" in logs[1]
    assert "error: watchdog: process 0" in logs[0] or "another process of this multi-host run failed" in logs[0], logs[
        0
    ][-3000:]
    last = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(last) == 1 and "process 1 stalled" in last[0] and "phase 'data' at step 15" in last[0], r.stderr[-3000:]
    assert "resume from step 10" in last[0]
    stall_started = json.loads(open(os.path.join(wd, "goodput.json")).read())["invocations"][0]["started_unix"]
    assert time.time() - t0 < 300 and stall_started > 0

    with open(os.path.join(wd, "checkpoints", "10", "data", "process_0-of-2.json"), "r+b") as f:
        f.write(b"#" * 8)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "resumed from step 10" in r.stdout
    assert "data iterator state of step 10 not restored" in r.stdout, r.stdout[-2000:]
    resumed = read_jsonl(os.path.join(wd, "metrics.jsonl"), "train/loss")
    one = str(tmp_path / "one")
    r1, _ = _train(
        one,
        *[f for f in flags if "distributed" not in f],
        env={"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"},
    )
    assert r1.returncode == 0, r1.stderr[-2000:]
    want = read_jsonl(os.path.join(one, "metrics.jsonl"), "train/loss")
    assert sorted(resumed) == list(range(1, steps + 1))
    np.testing.assert_allclose(
        [resumed[s] for s in sorted(resumed)], [want[s] for s in sorted(want)], rtol=1e-5, atol=1e-5
    )
