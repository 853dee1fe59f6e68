"""Nothing silently lost or wrong: checkpoint fingerprints, no restart from zero over a workdir
that held checkpoints, config changes told apart from damage, and the smaller resume cases."""

import os
import signal
import subprocess
import sys

import pytest

from resformer_jax.commands.training import run
from resformer_jax.metrics import read_jsonl
from resformer_jax.presets import tiny_config

pytestmark = pytest.mark.slow  # end-to-end: runs, commands, processes or compilers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cfg(steps=9, **model):
    c = tiny_config("svformer")
    c.train.steps, c.checkpoint.every_steps, c.train.log_every, c.train.eval_every = steps, 3, 1, 1000
    c.mesh.num_devices = 1
    for k, v in model.items():
        c.model[k] = v
    return c


def flip_bytes_in_largest_array_file(step_dir):
    files = [os.path.join(r, n) for r, _, names in os.walk(os.path.join(step_dir, "state")) for n in names]
    biggest = max(files, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.seek(os.path.getsize(biggest) // 2)
        data = f.read(8)
        f.seek(os.path.getsize(biggest) // 2)
        f.write(bytes(b ^ 0x5A for b in data))


def test_flipped_bytes_in_a_checkpoint_are_detected_and_the_previous_one_used(tmp_path, capsys):
    wd = str(tmp_path)
    assert run(cfg(), wd) == 0  # checkpoints at 3, 6, 9
    ref = read_jsonl(os.path.join(wd, "metrics.jsonl"), "train/loss")
    flip_bytes_in_largest_array_file(os.path.join(wd, "checkpoints", "9"))
    assert run(cfg(), wd) == 0
    out = capsys.readouterr()
    assert "checkpoint at step 9" in out.err and "does not match the fingerprint" in out.err, out.err
    assert "resumed from step 6" in out.out
    assert os.path.isdir(os.path.join(wd, "checkpoints_damaged", "9"))
    got = read_jsonl(os.path.join(wd, "metrics.jsonl"), "train/loss")
    assert [got[s] for s in (7, 8, 9)] == [ref[s] for s in (7, 8, 9)]  # retrained exactly from step 6


def test_requeue_after_total_damage_refuses_to_start_from_zero(tmp_path, capsys):
    wd = str(tmp_path)
    assert run(cfg(steps=3), wd) == 0
    flip_bytes_in_largest_array_file(os.path.join(wd, "checkpoints", "3"))
    assert run(cfg(steps=6), wd) == 2  # nothing restores: stop, set the damaged one aside
    assert "none of the checkpoints" in capsys.readouterr().err
    assert run(cfg(steps=6), wd) == 2  # the cluster requeues the same command
    err = capsys.readouterr().err
    assert "refusing to start again from step 0" in err and "checkpoints_damaged" in err and "['3']" in err
    assert not [s for s in os.listdir(os.path.join(wd, "checkpoints")) if s.isdigit()], "nothing was trained"
    c = cfg(steps=6)
    c.checkpoint.allow_fresh_start = True
    assert run(c, wd) == 0 and "starting a new run" in capsys.readouterr().out


def test_a_changed_structure_field_is_a_config_error_and_moves_nothing(tmp_path, capsys):
    wd = str(tmp_path)
    assert run(cfg(steps=3), wd) == 0
    assert run(cfg(steps=6, svformer_share="q"), wd) == 2  # not in any list of "shape" fields
    err = capsys.readouterr().err
    assert "config.model.svformer_share is 'q'" in err and "new --workdir" in err
    assert not os.path.exists(os.path.join(wd, "checkpoints_damaged"))
    assert os.path.isdir(os.path.join(wd, "checkpoints", "3"))
    # A change only the parameter tree shows (the saved config agrees): named from the trees.
    import ml_collections

    from resformer_jax.rundir import RunDir

    ck = RunDir(wd).checkpointer(ml_collections.ConfigDict({"max_to_keep": 3, "keep_period": 0, "async_save": False}))
    layout = ck.saved_params_layout(3)
    ck.close()
    assert any("value" in p for p in layout if p.startswith("layer_1")) and not any(
        "layers/block/attn/value" in p for p in layout
    ), "SVFormer layers >= 2 have no W_V"
    assert run(cfg(steps=6), wd) == 0 and "resumed from step 3" in capsys.readouterr().out


def test_steps_below_the_checkpoint_say_there_is_nothing_to_do(tmp_path, capsys):
    wd = str(tmp_path)
    assert run(cfg(steps=6), wd) == 0
    capsys.readouterr()
    assert run(cfg(steps=3), wd) == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out and "at step 6" in out and "raise --config.train.steps" in out


def test_async_saving_keeps_max_to_keep(tmp_path):
    wd = str(tmp_path)
    c = cfg(steps=12)
    c.checkpoint.every_steps, c.checkpoint.max_to_keep, c.checkpoint.async_save = 2, 2, True
    assert run(c, wd) == 0
    assert sorted(int(s) for s in os.listdir(os.path.join(wd, "checkpoints")) if s.isdigit()) == [10, 12]


def test_sigterm_during_start_up_exits_cleanly(tmp_path):
    wd = str(tmp_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resformer_jax.main",
            "--config=configs/tiny.py",
            f"--workdir={wd}",
            "--config.mesh.num_devices=1",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = []
    for line in proc.stdout:  # the trainer has started (its handlers are installed) but not yet compiled
        out.append(line)
        if "starting a new run" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=300)[0]
    text = "".join(out) + rest
    assert proc.returncode == 0, text
    assert "Traceback" not in text and ("stopped during start-up" in text or "preempted: saved" in text), text


def test_generate_on_a_missing_workdir_creates_nothing(tmp_path):
    missing = tmp_path / "no_such_run"
    r = subprocess.run(
        [sys.executable, "-m", "resformer_jax", "generate", f"--workdir={missing}", "--prompt_ids=1,2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and str(missing) in r.stderr, r.stderr
    assert not missing.exists()


def _train_until(wd, marker, *flags, env=None):
    """A tiny run in a subprocess, SIGTERM when `marker` is printed: (output, seconds from the signal to the exit,
    the return code)."""
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "resformer_jax.main", "--config=configs/tiny.py", f"--workdir={wd}", *flags],
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, sent = [], None
    for line in proc.stdout:
        out.append(line)
        if marker in line and sent is None:
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
    proc.wait(120)
    return "".join(out), (time.monotonic() - sent) if sent else None, proc.returncode


SLOW = [
    "--config.mesh.num_devices=1",
    "--config.train.steps=6",
    "--config.train.log_every=1",
    "--config.train.eval_every=3",
    "--config.train.eval_batches=40",
]


def test_sigterm_during_a_long_validation_saves_at_once_and_the_rerun_resumes_bitwise(tmp_path):
    """#73: a validation of 40 x 2 s is under way at step 3 when SIGTERM comes: the checkpoint of step 3 is saved
    within seconds (not after the validation), the process exits 0, and the rerun's losses are an uninterrupted
    run's, bit for bit. SIGTERM during the last step's validation: saved, and the run says it is done."""
    wd = str(tmp_path / "run")
    text, seconds, rc = _train_until(
        wd, "validation at step 3 is slowed", *SLOW, env={"RESFORMER_TEST_SLOW_EVAL": "3:2"}
    )
    assert rc == 0 and seconds is not None and seconds < 30, text
    assert "preempted: saved a checkpoint at step 3" in text and "Traceback" not in text, text
    assert "checkpoints: every 1 steps" not in text and "checkpoints: every " in text, text
    rerun = subprocess.run(
        [sys.executable, "-m", "resformer_jax.main", "--config=configs/tiny.py", f"--workdir={wd}", *SLOW],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "done: validation loss" in rerun.stdout + rerun.stderr  # the closing summary after a resume too
    whole = str(tmp_path / "whole")
    assert run(tiny_flags_config(SLOW), whole) == 0
    losses = lambda d: read_jsonl(os.path.join(d, "metrics.jsonl"), "train/loss")
    assert losses(wd) == losses(whole)

    last = str(tmp_path / "last")
    text, seconds, rc = _train_until(
        last, "validation at step 6 is slowed", *SLOW, env={"RESFORMER_TEST_SLOW_EVAL": "6:2"}
    )
    assert rc == 0 and seconds < 30, text
    assert "stopped at the last step (6) and saved it" in text and "rerun the same command" not in text, text
    assert "done." in text, text


def tiny_flags_config(flags):
    """configs/tiny.py with `--config.X=V` flags applied, as the command line would."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "configs", "tiny.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    for f in flags:
        key, value = f[len("--config.") :].split("=")
        section, name = key.split(".")
        c[section][name] = type(c[section][name])(value)
    return c
