"""Exact resume, preemption, damaged checkpoints, resharding, and resume checks."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from resformer_jax.commands.training import run
from resformer_jax.metrics import read_jsonl
from resformer_jax.presets import tiny_config

# end-to-end: runs, commands, processes or compilers; one worker runs this file, so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("checkpoint")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 12
FLAGS = [
    f"--config.train.steps={STEPS}",
    "--config.checkpoint.every_steps=3",
    "--config.train.log_every=1",
    "--config.train.eval_every=1000",
    "--config.mesh.num_devices=1",
]


def cfg(steps=STEPS):
    c = tiny_config("resformer")
    c.train.steps = steps
    c.checkpoint.every_steps = 3
    c.train.log_every = 1
    c.train.eval_every = 1000
    c.mesh.num_devices = 1
    return c


def losses(workdir):
    return read_jsonl(os.path.join(workdir, "metrics.jsonl"), "train/loss")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("ref"))
    assert run(cfg(), wd) == 0
    return losses(wd)


def _main(workdir, extra=()):
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # same XLA_FLAGS as this process: identical compiled code
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resformer_jax.main",
            "--config=configs/tiny.py",
            f"--workdir={workdir}",
            *FLAGS,
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run_until(proc, needle, timeout=180):
    """Reads the process's output until a line contains needle; returns what it read."""
    out, t0 = [], time.time()
    for line in proc.stdout:
        out.append(line)
        if needle in line:
            return "".join(out)
        assert time.time() - t0 < timeout, "".join(out)
    raise AssertionError("process ended before " + needle + ":\n" + "".join(out))


def assert_bitwise_from(resumed: dict, ref: dict, first_step: int):
    for s in range(first_step, STEPS + 1):
        assert resumed[s] == ref[s], f"step {s}: resumed {resumed[s]!r} != uninterrupted {ref[s]!r}"


def test_sigkill_then_rerun_is_bitwise_identical(tmp_path, reference):
    wd = str(tmp_path)
    p = _main(wd, ["--config.checkpoint.async_save=True"])
    _run_until(p, "step       8/")
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert run(cfg(), wd) == 0
    out = losses(wd)
    assert_bitwise_from(out, reference, 7)
    assert out[8] == reference[8]


def test_sigterm_saves_at_the_stopped_step_and_resumes(tmp_path, reference):
    wd = str(tmp_path)
    p = _main(wd)
    _run_until(p, "step       4/")
    p.send_signal(signal.SIGTERM)
    rest, _ = p.communicate(timeout=120)
    assert p.returncode == 0, rest
    assert "preempted: saved a checkpoint at step" in rest
    stopped = int(rest.split("saved a checkpoint at step ")[1].split(";")[0])
    assert stopped >= 4 and os.path.isdir(os.path.join(wd, "checkpoints", str(stopped)))
    assert run(cfg(), wd) == 0
    assert_bitwise_from(losses(wd), reference, stopped + 1)


def test_damaged_checkpoints_fall_back_a_truncated_array_and_unreadable_fingerprints(tmp_path, reference, capsys):
    """Step 9's largest array file cut in half, step 6's fingerprints overwritten (a checkpoint whose fingerprints
    do not read is damaged, not one written before fingerprints existed): both set aside, the run resumes from 3."""
    wd = str(tmp_path)
    c = cfg()
    c.train.stop_at = 9
    assert run(c, wd) == 0  # checkpoints at 3, 6, 9
    files = []
    for root, _, names in os.walk(os.path.join(wd, "checkpoints", "9", "state")):
        files += [os.path.join(root, n) for n in names]
    biggest = max(files, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 2)
    with open(os.path.join(wd, "checkpoints", "6", "fingerprints", "metadata"), "r+b") as f:
        f.seek(40)
        f.write(b"#" * 16)
    assert run(cfg(), wd) == 0
    err = capsys.readouterr()
    assert "checkpoint at step 9" in err.err and "does not restore" in err.err
    assert "checkpoint at step 6" in err.err and "the fingerprints saved with it do not read" in err.err, err.err
    assert "resumed from step 3" in err.out
    # the one field changed, as asked (model.matmuls=auto, resolved on this machine at each start, is no change)
    changed = [ln for ln in err.out.splitlines() if "changed on resume" in ln]
    assert changed == ["note: config.train.stop_at changed on resume: 9 -> 0"], changed
    for step in ("9", "6"):
        assert os.path.isdir(os.path.join(wd, "checkpoints_damaged", step)), "the damaged checkpoint is kept aside"
    assert_bitwise_from(losses(wd), reference, 4)


def test_save_on_2x4_mesh_resume_on_one_device(tmp_path, reference):
    wd = str(tmp_path)
    c = cfg()
    c.train.stop_at = 6
    c.mesh.num_devices, c.mesh.data, c.mesh.fsdp = 0, 2, 4
    assert run(c, wd) == 0
    assert run(cfg(), wd) == 0  # on 1 device
    out = losses(wd)
    for s in range(7, STEPS + 1):
        np.testing.assert_allclose(out[s], reference[s], rtol=1e-5)


def test_changed_model_shape_on_resume_names_field(tmp_path, capsys):
    wd = str(tmp_path)
    assert run(cfg(steps=3), wd) == 0
    c = cfg(steps=6)
    c.model.d_model = 128
    assert run(c, wd) == 2
    err = capsys.readouterr().err
    assert "config.model.d_model is 128, the run's 64" in err and "new --workdir" in err
    c = cfg(steps=6)
    c.train.peak_lr = 1e-3
    assert run(c, wd) == 0
    assert "config.train.peak_lr changed on resume" in capsys.readouterr().out


def test_no_checkpoint_restores_is_an_error_not_a_fresh_start(tmp_path, capsys):
    wd = str(tmp_path)
    assert run(cfg(steps=3), wd) == 0
    for root, _, names in os.walk(os.path.join(wd, "checkpoints", "3", "state")):
        for n in names:
            with open(os.path.join(root, n), "r+b") as f:
                f.truncate(0)
    assert run(cfg(steps=6), wd) == 2
    err = capsys.readouterr().err
    assert "none of the checkpoints" in err and "new --workdir" in err


def test_nonfinite_keeps_last_good_checkpoint(tmp_path, capsys):
    wd = str(tmp_path)
    c = cfg(steps=30)
    c.train.peak_lr = 1e30
    c.train.warmup_steps = 5
    assert run(c, wd) == 3
    err = capsys.readouterr().err
    step = int(err.split("non-finite at step ")[1].split(";")[0])
    kept = sorted(int(s) for s in os.listdir(os.path.join(wd, "checkpoints")) if s.isdigit())
    assert all(s <= step for s in kept), "no checkpoint after the non-finite step"
    if kept:
        assert f"last good checkpoint (step {kept[-1]}) is intact" in err


def test_a_resume_restores_every_item_without_orbax_warning_about_the_data(tmp_path, caplog):
    """Every checkpoint item has its handler registered (grain's for the data iterator), so Orbax no longer tells a
    resuming user that the data state "could not be restored" while it was (resumes are bitwise elsewhere)."""
    import logging

    from resformer_jax.presets import tiny_config

    c = tiny_config("resformer")
    c.train.steps, c.train.stop_at, c.train.warmup_steps, c.checkpoint.every_steps = 4, 2, 1, 2
    assert run(c, str(tmp_path)) == 0
    c.train.stop_at = 0
    with caplog.at_level(logging.WARNING):
        assert run(c, str(tmp_path)) == 0
    bad = [r.getMessage() for r in caplog.records if "could not be restored" in r.getMessage()]
    assert not bad, bad
