"""#74: the Hugging Face export under the newest transformers 4.x and the newest 5.x, each in an environment of its
own (torch and that transformers, no JAX), as a user loads it: fp32 logits equal the project's within round-off,
bf16's mean KL divergence per token at most 0.015 (the threshold MaxText's converters are checked by) on ordinary
text, random token ids and a full-length context, and `generate` with the cache gives the engine's greedy tokens.
For vanilla (a plain LlamaForCausalLM) and SVFormer (the export's own modeling code).

The environments are made once under RESFORMER_HF_ENVS (default /tmp/resformer_hf_envs) with pip; where pip cannot
reach a package index the test skips, saying so."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

# trained runs, exports and two environments of torch and transformers; one worker runs this file (its module
# fixtures are built once)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hf_versions")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERSIONS = {"4": "4.57.6", "5": "5.24.0"}  # the newest 4.x and 5.x when this was written
TORCH = "torch==2.13.0"  # the CPU build this machine keeps on disk (a wheel pip takes without downloading)
ENVS = os.environ.get("RESFORMER_HF_ENVS", "/tmp/resformer_hf_envs")


def environment(major: str) -> str:
    """The Python of an environment with torch and transformers VERSIONS[major], made on first use (one maker at a
    time: the suite's two workers may both want it)."""
    import fcntl

    folder = os.path.join(ENVS, f"transformers{VERSIONS[major]}")
    python = os.path.join(folder, "bin", "python")
    os.makedirs(ENVS, exist_ok=True)
    with open(os.path.join(ENVS, f"lock{major}"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(folder, "ready")):
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", folder], check=True)
        env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}  # not the project's pins: its own torch
        packages = [TORCH, f"transformers=={VERSIONS[major]}", "numpy", "safetensors"]
        subprocess.run([python, "-m", "pip", "install", "-q", "-U", "pip"], capture_output=True, env=env, timeout=600)
        r = subprocess.run(
            [python, "-m", "pip", "install", "-q", *packages], capture_output=True, text=True, env=env, timeout=1500
        )
        if r.returncode != 0:
            why = r.stderr[-500:]
            pytest.skip(f"could not install transformers {VERSIONS[major]} and {TORCH} (no package index?): {why}")
        open(os.path.join(folder, "ready"), "w").close()
    return python


@pytest.fixture(scope="module", params=["none", "svformer"])
def export(request, tmp_path_factory):
    """A tiny run on the demo corpus (a real tokenizer, real text), exported, and reference.npz beside it: the
    project's fp32 logits on three inputs and the engine's greedy tokens for a prompt."""
    from demo_runs import tokenized_tiny_config

    from resformer_jax.commands.training import run
    from resformer_jax.engine import Engine, SamplingParams
    from resformer_jax.hf.export import export_params
    from resformer_jax.load import load_run
    from resformer_jax.model import Transformer
    from resformer_jax.rundir import RunDir

    variant = request.param
    root = tmp_path_factory.mktemp(f"hf_{variant}")
    c = tokenized_tiny_config(steps=40)
    c.model.value_residual, c.model.dtype = variant, "float32"
    wd = str(root / "run")
    assert run(c, wd) == 0
    cfg, params, _ = load_run(wd)
    # the LM head scaled up: sharp distributions (a 40-step run's are nearly flat) make bf16's KL and greedy decoding
    # tell something, and no greedy tie is decided by float order between torch and XLA
    params = dict(params, lm_head={"kernel": np.asarray(params["lm_head"]["kernel"]) * 8.0})
    out = str(root / "export")
    export_params(cfg.model, jax.device_get(params), out)
    m = cfg.model.replace(dtype="float32")
    tok = RunDir(wd).tokenizer()
    text = open(os.path.join(ROOT, "resformer_jax", "engine", "engine.py")).read()  # Python, as the demo corpus
    ids = tok.encode(text, add_special_tokens=False).ids
    L = m.max_seq_len
    inputs = {
        "ordinary": np.array([ids[:64]]),
        "random": np.random.default_rng(0).integers(0, m.vocab_size, (1, 64)),
        "full": np.array([ids[1000 : 1000 + L]]),
    }
    forward = Transformer(m)
    ref = {}
    for name, tokens in inputs.items():
        ref[f"{name}_tokens"] = tokens.astype(np.int64)
        ref[f"{name}_logits"] = np.asarray(forward.apply({"params": params}, tokens), np.float32)
    prompt = ids[:12]
    engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=2)
    (r,) = engine.generate([prompt], SamplingParams(max_tokens=16))
    ref["prompt"], ref["greedy"] = np.array([prompt]), np.array([r.tokens])
    np.savez(os.path.join(root, "reference.npz"), **ref)
    return variant, out, os.path.join(root, "reference.npz")


@pytest.mark.parametrize("major", sorted(VERSIONS))
def test_the_export_loads_scores_and_generates_under_transformers(export, major):
    variant, out, reference = export
    python = environment(major)
    r = subprocess.run(
        [python, os.path.join(ROOT, "tests", "support", "hf_transformers_check.py"), out, reference],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print(variant, json.dumps(got))  # the measurements (pytest -s shows them; docs/evaluation.md quotes them)
    assert got["transformers"] == VERSIONS[major]
    for name, x in got["inputs"].items():
        assert x["max_abs_fp32"] <= 1e-4 * max(1.0, x["logit_scale"]), (variant, major, name, x)
        assert x["kl_bf16"] <= 0.015, (variant, major, name, x)
    assert got["greedy_equal"], (variant, major, got["generate"])
