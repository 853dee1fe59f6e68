"""Sweeps over variants and seeds, grouped comparisons with seed bands and a verdict."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from commands import run_command

from resformer_jax.analysis import grouping
from resformer_jax.analysis.measures import moving_average
from resformer_jax.model.config import ModelConfig

# end-to-end: runs, commands, processes or compilers; one worker runs this file, so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sweep")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = [
    "--config=configs/tiny.py",
    "--set",
    "model.value_residual=none,resformer",
    "--set",
    "train.seed=0,1",
    "--config.train.steps=20",
    "--config.train.log_every=1",
    "--config.train.eval_every=10",
    "--config.checkpoint.every_steps=5",
    "--config.mesh.num_devices=1",
]
NAMES = [
    "value_residual-none_seed-0",
    "value_residual-none_seed-1",
    "value_residual-resformer_seed-0",
    "value_residual-resformer_seed-1",
]


def sweep(workdir, *extra, **kw):
    return subprocess.run(
        [sys.executable, "-m", "resformer_jax", "sweep", f"--workdir={workdir}", *SWEEP, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        **kw,
    )


def losses(run):
    out = {}
    for line in open(os.path.join(run, "metrics.jsonl")):
        rec = json.loads(line)
        if "train/loss" in rec:
            out[rec["step"]] = rec["train/loss"]
    return out


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A 2 x 2 sweep, killed while its second run trains, then rerun to completion."""
    wd = str(tmp_path_factory.mktemp("sweep") / "s")
    proc = subprocess.Popen(
        [sys.executable, "-m", "resformer_jax", "sweep", f"--workdir={wd}", *SWEEP],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    second = os.path.join(wd, NAMES[1], "checkpoints")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.isdir(second) and any(
            os.path.isfile(os.path.join(second, d, "_CHECKPOINT_METADATA")) for d in os.listdir(second) if d.isdigit()
        ):
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and the run it is training, as a preempted job
    first_out = proc.communicate()[0]
    assert "[1/4]" in first_out and "starting" in first_out, first_out[-2000:]
    r = sweep(wd)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return wd, r.stdout


def test_sweep_creates_named_runs_and_manifest_and_resumes(swept):
    wd, out = swept
    manifest = json.load(open(os.path.join(wd, "sweep.json")))
    assert manifest["grid"] == {"model.value_residual": ["none", "resformer"], "train.seed": [0, 1]}
    assert [r["name"] for r in manifest["runs"]] == NAMES
    assert f"[1/4] {NAMES[0]}: finished (step 20), skipped" in out
    assert "resuming from step" in out and "sweep done: 4 runs" in out
    for name in NAMES:
        cfg = json.load(open(os.path.join(wd, name, "config.json")))
        assert cfg["model"]["value_residual"] == name.split("_seed")[0].split("-")[1]
        assert sorted(losses(os.path.join(wd, name))) == list(range(1, 21))
    again = run_command("sweep", f"--workdir={wd}", *SWEEP)  # everything finished: nothing runs (in-process)
    assert again.returncode == 0 and again.stdout.count("skipped") == 4
    other = run_command("sweep", f"--workdir={wd}", *SWEEP, "--set", "model.num_layers=2,3")
    assert other.returncode == 2 and "another grid" in other.stderr and "Traceback" not in other.stderr


def test_grouped_comparison_equals_direct_computation_and_verdict_flips(swept, tmp_path):
    wd, _ = swept
    out = str(tmp_path / "cmp")
    r = run_command(
        "compare",
        wd,
        "--group_by",
        "model.value_residual",
        "--baseline",
        "none",
        "--smooth",
        "5",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    rep = json.load(open(os.path.join(out, "grouped_comparison.json")))
    g = rep["groups"]["resformer"]
    # Direct: per seed, smoothed resformer minus smoothed vanilla (same seed: paired), then over seeds.
    sm = {n: moving_average([losses(os.path.join(wd, n))[s] for s in range(1, 21)], 5) for n in NAMES}
    rel = np.array([sm[NAMES[2]] - sm[NAMES[0]], sm[NAMES[3]] - sm[NAMES[1]]])
    assert g["paired"] and g["seeds"] == [0, 1] and g["band_kind"] == "min-max"
    np.testing.assert_allclose(g["relative"], rel.mean(0), atol=1e-12)
    np.testing.assert_allclose(g["low"], rel.min(0), atol=1e-12)
    np.testing.assert_allclose(g["high"], rel.max(0), atol=1e-12)
    assert g["final_spread"] == pytest.approx(rel[:, -1].max() - rel[:, -1].min())
    finals = [np.array([sm[NAMES[2]][-1], sm[NAMES[3]][-1]]), np.array([sm[NAMES[0]][-1], sm[NAMES[1]][-1]])]
    noise = np.sqrt(sum(((f - f.mean()) ** 2).sum() for f in finals) / 2)
    assert g["seed_noise"] == pytest.approx(noise)
    assert (abs(g["final_relative"]) > noise) == (g["verdict"] == "gap larger than seed noise")
    assert "eval/loss" in rep["relative_eval"] and os.path.isfile(os.path.join(out, "relative_validation_loss.png"))
    assert os.path.isdir(os.path.join(out, "tb", "resformer")) and "verdict" in r.stdout

    # Inject a gap far above the seed noise into the resformer runs: the verdict must say so.
    shifted = str(tmp_path / "shifted")
    shutil.copytree(wd, shifted)
    for name in NAMES[2:]:
        path = os.path.join(shifted, name, "metrics.jsonl")
        recs = [json.loads(x) for x in open(path)]
        with open(path, "w") as f:
            for rec in recs:
                if "train/loss" in rec:
                    rec["train/loss"] += 10 * noise + 0.5
                f.write(json.dumps(rec) + "\n")
    runs = [
        grouping.RunCurves(
            n, json.load(open(os.path.join(shifted, n, "config.json"))), losses(os.path.join(shifted, n)), {}
        )
        for n in NAMES
    ]
    shifted_res = grouping.compare_groups(runs, "model.value_residual", "none", smooth=5)
    assert shifted_res["resformer"].verdict == "gap larger than seed noise"
    tiny_gap = [
        grouping.RunCurves(
            n,
            r.config,
            {
                s: v + (noise / 10 if "resformer" in n else 0.0)
                for s, v in losses(os.path.join(wd, NAMES[0 if "seed-0" in n else 1])).items()
            },
            {},
        )
        for n, r in zip(NAMES, runs)
    ]
    assert (
        grouping.compare_groups(tiny_gap, "model.value_residual", "none", smooth=5)["resformer"].verdict
        == "within seed noise"
    )


def test_power_law_fit_recovers_known_exponents_and_savings():
    ns = np.array([2e6, 8e7, 1.8e8, 4.7e8])
    base = (12.0, 0.08)
    fit = grouping.fit_power_law(ns, base[0] * ns ** -base[1])
    assert fit == pytest.approx(base, rel=1e-9)
    # A variant that reaches, at N, the loss the baseline reaches at 1.25 N: it needs 1 - 1/1.25 = 20% fewer.
    variant = (base[0] * 1.25 ** -base[1], base[1])
    assert grouping.saving(variant, base, ns) == pytest.approx(0.2, rel=1e-9)
    assert grouping.needed_for_same_loss(variant, base, 1e8) == pytest.approx(0.8e8, rel=1e-9)


def test_sweep_writes_slurm_and_tpu_scripts_without_running(tmp_path):
    r = sweep(str(tmp_path / "sl"), "--slurm")
    assert r.returncode == 0, r.stderr
    text = open(tmp_path / "sl" / "sweep.sbatch").read()
    assert "#SBATCH --array=0-3" in text and "--signal=TERM@120" in text and NAMES[3] in text
    assert not os.path.exists(tmp_path / "sl" / NAMES[0])
    # Each array task is the shipped launcher on one run, with the launcher's own resources: run task 2 with a
    # stand-in srun that records its command line.
    launcher = open(os.path.join(ROOT, "launch", "slurm_gpu.sbatch")).read().splitlines()
    own = ("#SBATCH --job-name", "#SBATCH --output")
    assert all(ln in text for ln in launcher if ln.startswith("#SBATCH") and not ln.startswith(own))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n')
    (fake / "srun").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_ARRAY_TASK_ID": "2",
        "SRUN_ARGS": str(tmp_path / "srun_args"),
        "PYTHON": "python-of-the-node",
    }
    done = subprocess.run(["bash", str(tmp_path / "sl" / "sweep.sbatch")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "srun_args").read_text().split("\n")
    assert args[:4] == ["--kill-on-bad-exit=1", "python-of-the-node", "-m", "resformer_jax.main"], args
    assert "--config=configs/tiny.py" in args and f"--workdir={tmp_path / 'sl' / NAMES[2]}" in args, args
    r = sweep(str(tmp_path / "tpu"), "--tpu_pod=rf,us-east5-a,v5p-64")
    assert r.returncode == 0, r.stderr
    text = open(tmp_path / "tpu" / "sweep_tpu.sh").read()
    assert text.count("launch/tpu_pod.sh rf us-east5-a v5p-64 configs/tiny.py") == 4
    bad = sweep(str(tmp_path / "bad"), "--set", "model.d_modle=1,2")
    assert bad.returncode == 2 and "no such config field" in bad.stderr and "Traceback" not in bad.stderr


def test_compare_scaling_readout_on_runs_following_known_power_laws(tmp_path):
    """Runs of three sizes per variant whose validation losses follow a known law L = 9 (k_n N)^-0.07 (k_d D)^-0.05:
    the variant is worth k_n = 1.25 times the parameters and k_d = 1.1 times the tokens, so at equal tokens
    it matches a baseline with k_n k_d^(0.05/0.07) times its parameters, and at equal size one trained on
    k_d k_n^(0.07/0.05) times its tokens."""
    from resformer_jax.perf import model_flops
    from resformer_jax.presets import tiny_config

    for variant, k_n, k_d in (("none", 1.0, 1.0), ("resformer", 1.25, 1.1)):
        for d in (32, 64, 128):
            c = tiny_config(variant)
            c.model.d_model, c.model.ffn_dim = d, 2 * d
            n = model_flops(ModelConfig.of(c.model), c.data.seq_len).params_non_embedding
            run = tmp_path / f"{variant}_{d}"
            run.mkdir()
            (run / "config.json").write_text(c.to_json())
            tokens_per_step = c.train.global_batch * c.data.seq_len
            with open(run / "metrics.jsonl", "w") as f:
                for step in (10, 20, 30):
                    f.write(json.dumps({"step": step, "train/loss": 5.0}) + "\n")
                    loss = 9.0 * (k_n * n) ** -0.07 * (k_d * step * tokens_per_step) ** -0.05
                    f.write(json.dumps({"step": step, "eval/loss": loss}) + "\n")
    out = tmp_path / "cmp"
    r = run_command(
        "compare",
        str(tmp_path),
        "--group_by",
        "model.value_residual",
        "--baseline",
        "none",
        "--scaling",
        "--scaling_loss=validation",
        "--smooth",
        "1",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    sc = json.load(open(out / "grouped_comparison.json"))["scaling"]
    want_n = 1 - 1 / (1.25 * 1.1 ** (0.05 / 0.07))
    want_d = 1 - 1 / (1.1 * 1.25 ** (0.07 / 0.05))
    assert sc["resformer"]["fewer_params_for_same_loss"] == pytest.approx(want_n, abs=1e-6)
    assert sc["resformer"]["fewer_tokens_for_same_loss"] == pytest.approx(want_d, abs=1e-6)
    assert f"resformer needs {100 * want_n:.2f}% fewer parameters" in r.stdout and (out / "scaling.png").is_file()


def test_compare_vs_sequence_length_finds_and_predicts_critical_points(tmp_path):
    """Fig. 11 right from runs: SVFormer ahead early, overtaken at a step that grows with the sequence length."""
    from resformer_jax.presets import tiny_config

    cross = {32: 30, 64: 60}  # relative loss crosses zero at these steps; 64's run ends before: predicted
    for seq_len, at in cross.items():
        for variant in ("none", "svformer"):
            c = tiny_config(variant)
            c.data.seq_len = seq_len
            run = tmp_path / f"{variant}_{seq_len}"
            run.mkdir()
            (run / "config.json").write_text(c.to_json())
            with open(run / "metrics.jsonl", "w") as f:
                for step in range(1, 51):
                    rel = (step - at) / 100.0 if variant == "svformer" else 0.0
                    f.write(json.dumps({"step": step, "train/loss": 5.0 + rel}) + "\n")
    out = tmp_path / "cmp"
    r = run_command(
        "compare",
        str(tmp_path),
        "--group_by",
        "model.value_residual",
        "--baseline",
        "none",
        "--vs",
        "data.seq_len",
        "--smooth",
        "1",
        "--last",
        "20",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    cp = json.load(open(out / "grouped_comparison.json"))["critical_points"]["svformer"]
    assert cp["32"] == {"critical_step": 30.0, "predicted": False, "final_relative": pytest.approx(0.2)}
    assert cp["64"]["predicted"] and cp["64"]["critical_step"] == pytest.approx(60.0)
    assert cp["fit"]["b"] > 0 and (out / "critical_points.png").is_file()


def _synthetic_run(folder, variant, seq_len, losses_by_step, evals=None):
    from resformer_jax.presets import tiny_config

    c = tiny_config(variant)
    c.data.seq_len = seq_len
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(c.to_json())
    with open(folder / "metrics.jsonl", "w") as f:
        for step, loss in sorted(losses_by_step.items()):
            f.write(json.dumps({"step": step, "train/loss": loss}) + "\n")
        for step, loss in sorted((evals or {}).items()):
            f.write(json.dumps({"step": step, "eval/loss": loss}) + "\n")


@pytest.mark.parametrize("log_every", [1, 10])
def test_critical_step_is_counted_in_training_steps_whatever_log_every(log_every):
    """Fig. 11: a noise-free crossing at step 2,688 (relative loss linear in the step). Logged every `log_every`
    steps (each point the mean of the steps since the last), the crossing is found within one logging interval
    with no further smoothing, and a 100-step window gives the same step for log_every 1 and 10 (within one
    interval): windows and --last count training steps, not logged points."""
    at, steps = 2688, 4000
    per_step = {s: (s - at) / 1000.0 for s in range(1, steps + 1)}
    logged = {
        s: float(np.mean([per_step[t] for t in range(s - log_every + 1, s + 1)]))
        for s in range(log_every, steps + 1, log_every)
    }
    base = {s: 0.0 for s in logged}
    rel = grouping.smoothed(logged, log_every)
    b = grouping.smoothed(base, log_every)
    found, predicted = grouping.critical_point(sorted(rel), [rel[s] - b[s] for s in sorted(rel)], last=1000)
    assert not predicted and abs(found - at) <= log_every, found
    sm = grouping.smoothed(logged, 100)
    found100, _ = grouping.critical_point(sorted(sm), [sm[s] for s in sorted(sm)], last=1000)
    ref = grouping.smoothed(per_step, 100)
    want100, _ = grouping.critical_point(sorted(ref), [ref[s] for s in sorted(ref)], last=1000)
    assert abs(found100 - want100) <= log_every and abs(want100 - (at + 49.5)) <= 1, (found100, want100)
    # a crossing after the run's end is predicted from a line over the last 1,000 training steps
    early = {s: v for s, v in logged.items() if s <= 2000}
    step, predicted = grouping.critical_point(sorted(early), [early[s] for s in sorted(early)], last=1000)
    # (each logged point is the mean of the steps since the last: it sits (log_every - 1) / 2 steps early)
    assert predicted and abs(step - (at + (log_every - 1) / 2)) < 1e-6 * at, step


def test_mixed_lengths_are_refused_as_one_comparison_and_grouped_with_vs(tmp_path):
    """A folder holding 512- and 2,048-token runs is never merged into one table: without --vs the command names
    the differing field; with --vs data.seq_len each length is its own comparison (per-length curves)."""
    for seq_len, gap in ((32, -0.2), (64, -0.1)):
        for v in ("none", "svformer"):
            _synthetic_run(
                tmp_path / "runs" / f"{v}_{seq_len}",
                v,
                seq_len,
                {s: 5.0 - s / 100 + (gap if v == "svformer" else 0.0) for s in range(1, 41)},
            )
    cmd = [
        "compare",
        str(tmp_path / "runs"),
        "--group_by",
        "model.value_residual",
        "--baseline",
        "none",
        "--smooth",
        "1",
        "--out",
        str(tmp_path / "cmp"),
    ]
    r = run_command(*cmd)
    assert r.returncode == 2 and "data.seq_len" in r.stderr and "--vs" in r.stderr and "Traceback" not in r.stderr
    r = run_command(*cmd, "--vs", "data.seq_len", "--last", "10")
    assert r.returncode == 0, r.stderr
    groups = json.load(open(tmp_path / "cmp" / "grouped_comparison.json"))["groups"]
    assert groups["svformer [data.seq_len=32]"]["final_relative"] == pytest.approx(-0.2)
    assert groups["svformer [data.seq_len=64]"]["final_relative"] == pytest.approx(-0.1)


def test_scaling_against_parameters_uses_the_mean_training_loss_of_the_last_50_steps(tmp_path):
    """Fig. 5 middle: loss against model size is the mean training loss of the last 50 training steps (logged
    every 10 here: the last 5 points), not the final validation loss."""
    from resformer_jax.perf import model_flops
    from resformer_jax.presets import tiny_config

    want = {}
    for v in ("none", "resformer"):
        for d in (32, 64):
            c = tiny_config(v)
            c.model.d_model, c.model.ffn_dim = d, 2 * d
            run = tmp_path / "runs" / f"{v}_{d}"
            run.mkdir(parents=True)
            (run / "config.json").write_text(c.to_json())
            train = {s: 6.0 - d / 100 - s / 1000 - (0.05 if v == "resformer" else 0) for s in range(10, 201, 10)}
            with open(run / "metrics.jsonl", "w") as f:
                for s, loss in train.items():
                    f.write(json.dumps({"step": s, "train/loss": loss, "eval/loss": loss + 1}) + "\n")
            n = model_flops(ModelConfig.of(c.model), c.data.seq_len).params_non_embedding
            want.setdefault(v, {})[n] = np.mean([train[s] for s in (160, 170, 180, 190, 200)])
    r = run_command(
        "compare",
        str(tmp_path / "runs"),
        "--group_by",
        "model.value_residual",
        "--baseline",
        "none",
        "--scaling",
        "--smooth",
        "1",
        "--out",
        str(tmp_path / "cmp"),
    )
    assert r.returncode == 0, r.stderr
    sc = json.load(open(tmp_path / "cmp" / "grouped_comparison.json"))["scaling"]
    for v in want:
        assert sc[v]["loss_measure"] == "train_last50"
        assert sc[v]["final_loss"] == pytest.approx([want[v][n] for n in sorted(want[v])])
    assert "last 50 steps" in r.stdout


def test_a_tuple_field_sweeps_with_plus_joined_items_that_the_runs_accept(tmp_path):
    """Fig. 14's anchors: `--set model.svformer_anchors=none,5,3+5+7` gives three runs whose flags the training
    command parses back to (), (5,) and (3, 5, 7)."""
    wd = tmp_path / "fig14"
    r = run_command(  # in-process, as the summaries below: --slurm writes the script and runs nothing
        "sweep", "--config=configs/svformer_82m.py", f"--workdir={wd}", "--set", "model.svformer_anchors=none,5,3+5+7",
        "--slurm",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    runs = json.load(open(wd / "sweep.json"))["runs"]
    assert [x["name"] for x in runs] == ["svformer_anchors-none", "svformer_anchors-5", "svformer_anchors-3+5+7"]
    for x, want in zip(runs, ([], [5], [3, 5, 7])):
        flag = next(
            f"--config.{k}=" + ("(" + ",".join(map(str, v)) + ("," if len(v) == 1 else "") + ")")
            for k, v in x["values"].items()
        )
        assert f"'{flag}'" in (wd / "sweep.sbatch").read_text()
        s = run_command("train", "--config=configs/svformer_82m.py", flag, "--mode=summary")
        assert json.loads(s.stdout.strip().splitlines()[-1])["model"]["svformer_anchors"] == want, s.stderr


@pytest.mark.parametrize(
    "accel,version",
    [
        ("v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v5e-8", "v2-alpha-tpuv5-lite"),
        ("v5p-64", "v2-alpha-tpuv5"),
        ("v6e-8", "v2-alpha-tpuv6e"),
        ("v4-8", "tpu-ubuntu2204-base"),
    ],
)
def test_tpu_pod_launcher_picks_the_runtime_of_the_accelerator_type(tmp_path, accel, version):
    """launch/tpu_pod.sh against a stand-in gcloud that records its arguments: the VM is created with the runtime
    image that generation needs; TPU_SOFTWARE_VERSION overrides it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "gcloud").write_text(
        '#!/usr/bin/env bash\necho "gcloud $*" >> "$GCLOUD_LOG"\ncase "$*" in *describe*) exit 1;; esac\nexit 0\n'
    )
    (fake / "gcloud").chmod(0o755)
    log = tmp_path / "gcloud.log"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "GCLOUD_LOG": str(log), "REPO_URL": "x"}
    script = os.path.join(ROOT, "launch", "tpu_pod.sh")
    subprocess.run(
        ["bash", script, "n", "z", accel, "configs/tiny.py", "gs://b/r"], env=env, capture_output=True, timeout=60
    )
    assert f"--version={version}" in log.read_text()
    log.unlink()
    subprocess.run(
        ["bash", script, "n", "z", accel, "configs/tiny.py", "gs://b/r"],
        capture_output=True,
        timeout=60,
        env={**env, "TPU_SOFTWARE_VERSION": "my-image"},
    )
    assert "--version=my-image" in log.read_text()


def test_compare_against_a_categorical_field_gives_each_value_its_comparison(tmp_path):
    """--vs train.optimizer (not a number like data.seq_len): one comparison per optimizer, no exponential fit."""
    from resformer_jax.presets import tiny_config

    for variant, gap in (("none", 0.0), ("resformer", 0.05)):
        for optimizer, base in (("adamw", 5.0), ("muon", 4.5)):
            c = tiny_config(variant)
            c.train.optimizer = optimizer
            run = tmp_path / f"{variant}_{optimizer}"
            run.mkdir()
            (run / "config.json").write_text(c.to_json())
            with open(run / "metrics.jsonl", "w") as f:
                for step in range(10, 210, 10):
                    f.write(json.dumps({"step": step, "train/loss": base - step / 1000 - gap}) + "\n")
    r = run_command(
        "compare", str(tmp_path), "--group_by", "model.value_residual", "--baseline", "none",
        "--vs", "train.optimizer", "--smooth", "20", f"--out={tmp_path / 'cmp'}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resformer [train.optimizer=adamw]" in r.stdout and "resformer [train.optimizer=muon]" in r.stdout
    assert "resformer at train.optimizer=muon" in r.stdout and "exp(" not in r.stdout, r.stdout


def test_compare_baseline_names_the_other_fields_in_which_runs_differ(tmp_path, capsys):
    """`compare --baseline A B`: a B that differs from A in more than the value residual (optimizer, schedule,
    steps) is compared, but each such field is named (the grouped mode refuses the merge)."""
    import json

    from resformer_jax.analysis.compare import CompareOptions, pairwise
    from resformer_jax.config import base_config

    def fake_run(name, value_residual, **train):
        c = base_config()
        c.model.value_residual = value_residual
        for k, v in train.items():
            c.train[k] = v
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c.to_dict()))
        (d / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "train/loss": 5.0 - s / 100}) + "\n" for s in range(1, 31))
        )
        return str(d)

    a = fake_run("vanilla", "none")
    b = fake_run("svformer_muon", "svformer", optimizer="muon", steps=30)
    c = fake_run("resformer", "resformer")
    assert pairwise(CompareOptions(runs=[b, c], baseline=a, out=str(tmp_path / "out"), smooth=1)) == 0
    out = capsys.readouterr().out
    assert "note: svformer_muon differs from the baseline vanilla" in out
    assert "train.optimizer 'muon' (baseline 'adamw')" in out and "train.steps" in out, out
    assert "note: resformer" not in out  # the value residual alone: nothing to say
