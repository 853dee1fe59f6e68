"""Meshes, FSDP sharding, multi-process runs and the memory precheck (issue 5)."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from resformer_jax.config import tiny_config
from resformer_jax.parallel.mesh import MeshError, make_mesh
from resformer_jax.commands.training import run
from resformer_jax.train.loop import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def losses(workdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(os.path.join(workdir, "tb"))
    ea.Reload()
    return np.array([e.value for e in ea.Scalars("train/loss")])


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
    assert dict(t.mesh.shape) == {"data": 2, "fsdp": 4}
    checked = 0
    for (path, leaf), sh in zip(jax.tree_util.tree_leaves_with_path(t.state.params), jax.tree.leaves(t.state_sh.params)):
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
    mu = t.state.opt_state[1][0].mu
    k = mu["embed"]["embedding"]
    assert k.addressable_shards[0].data.shape[1] * 4 == k.shape[1]


def test_local_multiprocess_matches_single_process(tmp_path, one_device_losses):
    wd = str(tmp_path / "mp")
    env = dict(os.environ, PYTHON=sys.executable, DEVICES_PER_PROCESS="2")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(["bash", os.path.join(ROOT, "launch", "local_multiprocess.sh"), "2", "configs/tiny.py", wd,
                        "--config.model.num_kv_heads=2", "--config.train.steps=5", "--config.train.log_every=1",
                        "--config.train.eval_every=1000", "--config.checkpoint.every_steps=1000"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "4 devices" in r.stdout
    np.testing.assert_allclose(losses(wd), one_device_losses, rtol=1e-5, atol=1e-5)
    assert not os.path.exists(os.path.join(wd, "tb_1")), "only process 0 writes logs"


def test_memory_precheck_refuses_before_training(tmp_path, capsys):
    c = cfg()
    c.mesh.device_memory_limit_gb = 1e-5
    assert run(c, str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "per device but config.mesh.device_memory_limit_gb is" in err and "remat=full" in err
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
