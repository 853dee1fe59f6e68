"""Meshes, FSDP sharding, multi-process runs and the memory precheck."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from commands import multiprocess_env
from tb_losses import losses

from resformer_jax.commands.training import run
from resformer_jax.parallel.mesh import MeshError, make_mesh
from resformer_jax.presets import tiny_config
from resformer_jax.train.loop import Trainer

# end-to-end: runs, commands, processes or compilers; one worker runs this file, so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parallel")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cfg(steps=5, **mesh):
    c = tiny_config("resformer")
    c.model.num_kv_heads = 2
    c.train.steps = steps
    c.train.log_every = 1
    c.train.eval_every = 1000
    c.checkpoint.every_steps = 1000
    for k, v in mesh.items():
        c.mesh[k] = v
    return c


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("one"))
    assert run(cfg(num_devices=1, data=1, fsdp=1), wd) == 0
    return losses(wd)


def test_fsdp_mesh_matches_one_device_and_shards_params(tmp_path, one_device_losses):
    assert len(jax.devices()) == 8
    t = Trainer(cfg(data=2, fsdp=4), str(tmp_path))
    assert t.train() == 0
    np.testing.assert_allclose(losses(str(tmp_path)), one_device_losses, rtol=1e-5, atol=1e-5)
    assert dict(t.session.setup.mesh.shape) == {"data": 2, "fsdp": 4, "context": 1}
    checked = 0
    for (path, leaf), sh in zip(
        jax.tree_util.tree_leaves_with_path(t.session.state.params), jax.tree.leaves(t.session.setup.state_sh.params)
    ):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim), path
        spec = tuple(sh.spec)
        if "fsdp" in spec:
            ax = spec.index("fsdp")
            shard = leaf.addressable_shards[0].data.shape
            assert shard[ax] * 4 == leaf.shape[ax], (path, shard, leaf.shape)
            checked += 1
        elif leaf.ndim >= 2:
            raise AssertionError(f"weight {path} is not sharded over fsdp")
    assert checked >= 10
    # Optimizer moments are sharded like their parameters.
    mu = t.session.state.opt_state[1][0].mu
    k = mu["embed"]["embedding"]
    assert k.addressable_shards[0].data.shape[1] * 4 == k.shape[1]


def test_memory_precheck_refuses_before_training(tmp_path, capsys):
    c = cfg()
    c.mesh.device_memory_limit_gb = 1e-5
    assert run(c, str(tmp_path)) == 2
    err = capsys.readouterr().err
    # the analytic estimate already refuses it, before the probe and the compile
    assert "per device by the analytic estimate" in err and "config.mesh.device_memory_limit_gb is" in err, err
    assert "remat=full" in err
    assert not os.path.exists(os.path.join(str(tmp_path), "checkpoints", "1"))


def test_bad_mesh_and_batch_messages(tmp_path, capsys):
    with pytest.raises(MeshError, match="does not divide"):
        make_mesh(cfg(data=3, fsdp=-1).mesh)
    c = cfg(data=2, fsdp=4)
    c.train.global_batch = 12
    assert run(c, str(tmp_path)) == 2
    assert "global_batch=12 does not divide over 8 devices" in capsys.readouterr().err
    c = cfg(data=1, fsdp=8)
    c.model.d_model = 68
    c.model.num_heads = 2
    assert run(c, str(tmp_path)) == 2
    assert "model.d_model=68 does not divide" in capsys.readouterr().err


def test_a_dead_process_is_named_by_the_launcher_and_a_rerun_resumes_to_the_same_losses(tmp_path):
    """2 processes x 2 CPU devices; process 1 SIGKILLed after the first checkpoint. Process 0 is stopped by JAX's
    coordination service within the (shortened) heartbeat timeout, the launcher's last line names the process that
    died first and the step to resume from, and the same command rerun finishes with the losses of a run that was
    never interrupted on one device, every step (those before the kill: the first multi-process run's own); only
    process 0 writes logs."""
    import signal
    import time

    from resformer_jax.metrics import read_jsonl

    steps, every = 40, 10
    flags = [
        "--config.model.num_kv_heads=2",
        f"--config.train.steps={steps}",
        "--config.train.log_every=1",
        "--config.train.eval_every=1000",
        f"--config.checkpoint.every_steps={every}",
        "--config.distributed.heartbeat_timeout_s=5",
    ]
    wd = str(tmp_path / "mp")
    env = multiprocess_env(2)
    cmd = ["bash", os.path.join(ROOT, "launch", "local_multiprocess.sh"), "2", "configs/tiny.py", wd, *flags]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpt = os.path.join(wd, "checkpoints", str(every))
    deadline = time.time() + 240
    while not os.path.isdir(ckpt) and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    assert os.path.isdir(ckpt), "no checkpoint appeared"
    pid1 = subprocess.run(
        ["pgrep", "-f", "--", f"--workdir={wd} .*--process_id=1"], capture_output=True, text=True
    ).stdout.split()
    assert pid1, "process 1 already gone"
    os.kill(int(pid1[0]), signal.SIGKILL)
    killed = time.time()
    _out, err = p.communicate(timeout=120)
    assert time.time() - killed < 60, "the surviving process outlived the heartbeat timeout by far"
    assert p.returncode != 0
    last = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(last) == 1 and "process 1 died first" in last[0] and "SIGKILL" in last[0], err[-2000:]
    assert "heartbeat_timeout_s=5" in last[0] and "resume from step" in last[0], last[0]
    log0 = open(os.path.join(wd, "logs", "process_0.log")).read()
    if "another process of this multi-host run failed" in log0:  # JAX let Python see the peer's failure first
        assert "Traceback" not in log0 and "Fatal Python error" not in log0, log0[-3000:]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "resumed from step" in r.stdout and "4 devices" in r.stdout
    assert not os.path.exists(os.path.join(wd, "tb_1")), "only process 0 writes logs"
    resumed = read_jsonl(os.path.join(wd, "metrics.jsonl"), "train/loss")
    one = str(tmp_path / "one")
    c = cfg(steps=steps, num_devices=1, data=1, fsdp=1)
    c.checkpoint.every_steps = every
    assert run(c, one) == 0
    want = read_jsonl(os.path.join(one, "metrics.jsonl"), "train/loss")
    assert sorted(resumed) == list(range(1, steps + 1))
    np.testing.assert_allclose(
        [resumed[s] for s in sorted(resumed)], [want[s] for s in sorted(want)], rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow
def test_in_loop_tasks_of_a_multi_host_run_equal_evaluate(tmp_path):
    """2 processes x 2 CPU devices, zero-shot PIQA inside the loop on the sharded parameters (every process scores
    the same items): the accuracies equal `resformer evaluate` on the same checkpoint in one process."""
    samples = os.path.join(ROOT, "..", "shared", "data", "eval_samples")
    if not os.path.isdir(samples):
        pytest.skip("../shared/data/eval_samples is absent (the shared data folder beside the repo)")
    wd = str(tmp_path / "mp")
    flags = [
        "--config.data.source=demo",
        "--config.model.vocab_size=1024",
        "--config.data.seq_len=64",
        "--config.model.max_seq_len=256",
        "--config.model.num_kv_heads=2",
        "--config.train.steps=4",
        "--config.eval.tasks=piqa",
        "--config.eval.tasks_every=4",
        f"--config.eval.task_data={samples}",
        "--config.eval.task_limit=8",
    ]
    env = multiprocess_env(2)
    cmd = ["bash", os.path.join(ROOT, "launch", "local_multiprocess.sh"), "2", "configs/tiny.py", wd, *flags]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rec = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
    got = [x for x in rec if "tasks/piqa/acc" in x][-1]
    cmd = [sys.executable, "-m", "resformer_jax", "evaluate", f"--workdir={wd}", "--tasks=piqa"]
    r = subprocess.run(
        cmd + [f"--task_data={samples}", "--limit=8"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    want = json.load(open(os.path.join(wd, "eval", "zero_shot_step4.json")))["tasks"]["piqa"]
    assert (got["tasks/piqa/acc"], got["tasks/piqa/acc_norm"]) == (want["acc"], want["acc_norm"])
