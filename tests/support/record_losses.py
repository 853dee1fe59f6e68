"""Per-step training losses of the tiny runs tests/project/test_structure.py holds, on this machine.

XLA's CPU code depends on the instruction set (AVX2, AVX-512, AMX) and the host, so these losses are
bitwise only on one machine. To check that a change keeps numerics bitwise, record before and after
on the same machine:

  .venv/bin/python tests/support/record_losses.py /tmp/before.json          # before the change
  RESFORMER_LOSSES_BASELINE=/tmp/before.json .venv/bin/python -m pytest -q tests/project/test_structure.py

Without RESFORMER_LOSSES_BASELINE the test compares with RECORDED within a tolerance that holds
across CPUs (a few ulp) and still catches a real change.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys
import tempfile

VARIANTS = ("resformer", "svformer", "none")
STEPS = 12


def cpu_description() -> str:
    """The CPU's model name and the instruction-set extensions that change XLA's CPU code."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:  # not Linux: the platform's own name
        pass
    model = model or platform.processor() or platform.machine()
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile") if f in flags]
    return f"{model} ({', '.join(isa) or 'no AVX2'})"


def tiny_run_losses(root: str) -> dict[str, list[float]]:
    """`tiny_config(variant)`, train.steps=12, log_every=1: each variant's per-step training losses."""
    from resformer_jax.commands.training import run
    from resformer_jax.presets import tiny_config

    out = {}
    for variant in VARIANTS:
        c = tiny_config(variant)
        c.train.log_every, c.train.steps, c.checkpoint.every_steps = 1, STEPS, 100
        workdir = pathlib.Path(root) / variant
        assert run(c, str(workdir)) == 0
        out[variant] = [json.loads(ln)["train/loss"] for ln in open(workdir / "metrics.jsonl") if "train/loss" in ln]
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/support/record_losses.py OUT.json")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: its conftest
    import conftest  # noqa: F401 - the suite's environment (8 CPU devices, the XLA flags)

    with tempfile.TemporaryDirectory() as tmp:
        losses = tiny_run_losses(tmp)
    pathlib.Path(sys.argv[1]).write_text(json.dumps({"cpu": cpu_description(), "losses": losses}, indent=1))
    print(f"recorded on {cpu_description()} -> {sys.argv[1]}")
