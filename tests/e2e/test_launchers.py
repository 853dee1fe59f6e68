"""The cluster launchers take a scale-out preset and its cluster's mesh without edits (#92): launch/slurm_gpu.sbatch
and launch/tpu_pod.sh run against stand-in srun / gcloud that record their command lines."""

import os
import subprocess

from absl import flags
from ml_collections import config_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fake_tool(tmp_path, name: str, body: str) -> dict:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / name).write_text("#!/usr/bin/env bash\n" + body)
    (fake / name).chmod(0o755)
    return {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}


def parsed(config: str):
    """The config the training command builds from `--config=CONFIG` (absl and ml_collections' own parsing)."""
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True)
    fv(["prog", f"--config={config}"])
    return fv.config


def test_slurm_launcher_runs_the_preset_on_its_clusters_mesh(tmp_path):
    env = fake_tool(tmp_path, "srun", 'printf "%s\\n" "$@" > "$SRUN_ARGS"\n')
    env.update(SRUN_ARGS=str(tmp_path / "args"), PYTHON="python-of-the-node")
    script = os.path.join(ROOT, "launch", "slurm_gpu.sbatch")
    done = subprocess.run(
        ["bash", script, "configs/resformer_7b.py:4xh100x8", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "args").read_text().split("\n")
    assert "--config=configs/resformer_7b.py:4xh100x8" in args
    assert not [a for a in args if a.startswith("--config.mesh")], f"the launcher overrode the preset's mesh: {args}"
    c = parsed(os.path.join(ROOT, "configs/resformer_7b.py") + ":4xh100x8")
    assert (c.mesh.data, c.mesh.fsdp) == (4, 8) and c.model.value_residual == "resformer"


def test_tpu_pod_launcher_runs_the_preset_on_its_clusters_mesh(tmp_path):
    env = fake_tool(
        tmp_path, "gcloud", 'echo "gcloud $*" >> "$GCLOUD_LOG"\ncase "$*" in *describe*) exit 1;; esac\nexit 0\n'
    )
    env.update(GCLOUD_LOG=str(tmp_path / "gcloud.log"), REPO_URL="x")
    script = os.path.join(ROOT, "launch", "tpu_pod.sh")
    done = subprocess.run(
        ["bash", script, "n", "z", "v5p-128", "configs/svformer_7b.py:v5p-128", "gs://b/r"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    train = [ln for ln in (tmp_path / "gcloud.log").read_text().splitlines() if "resformer_jax.main" in ln]
    assert len(train) == 1 and "--config=configs/svformer_7b.py:v5p-128" in train[0], train
    assert "--config.mesh" not in train[0], f"the launcher overrode the preset's mesh: {train[0]}"
    c = parsed(os.path.join(ROOT, "configs/svformer_7b.py") + ":v5p-128")
    assert (c.mesh.data, c.mesh.fsdp) == (1, 64) and c.model.value_residual == "svformer"
