"""XLA settings the project sets for you, where they are known to be safe.

Every entry point (train, bench, generate, evaluate) calls `configure_xla()`
before JAX starts its backend. A flag you already put in XLA_FLAGS is never
overridden; RESFORMER_NO_XLA_DEFAULTS=1 turns all of this off.

GPU (set when a CUDA plugin for JAX is installed): the flags MaxText runs
H100 training with, minus the ones that trade memory for speed blindly.
Each is about overlapping communication with the scanned layers' compute,
or about picking the faster GEMM path; none changes numerics beyond the
summation order of collectives.

CPU and TPU: nothing. On CPU the XNNPACK/oneDNN/YNN paths of this XLA were
measured on the attention of the 82M step and were no faster (within the
host's noise); on TPU libtpu's defaults already overlap
collectives and its flags cannot be checked without a TPU.
"""
from __future__ import annotations

import importlib.util
import os

# flag -> (value, why)
GPU_XLA_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": (
        "true", "schedule FSDP all-gathers / reduce-scatters to overlap the layers' matmuls"),
    "xla_gpu_enable_while_loop_double_buffering": (
        "true", "layers run as one nn.scan (a while loop): double-buffer it so layer n+1's weights "
                "are gathered while layer n computes"),
    "xla_gpu_enable_pipelined_all_gather": ("true", "same, for the all-gather inside the scanned layers"),
    "xla_gpu_enable_pipelined_reduce_scatter": ("true", "same, for the gradient reduce-scatter"),
    "xla_gpu_enable_pipelined_all_reduce": ("true", "same, for data-parallel gradient all-reduces"),
    "xla_gpu_all_reduce_combine_threshold_bytes": (
        "134217728", "combine small per-parameter all-reduces into 128 MiB ones"),
    "xla_gpu_all_gather_combine_threshold_bytes": ("134217728", "combine small all-gathers (128 MiB)"),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": ("67108864", "combine small reduce-scatters (64 MiB)"),
    "xla_gpu_enable_triton_gemm": (
        "false", "cuBLAS is faster than Triton GEMMs for these dense projections on H100"),
}


def cuda_plugin_present() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() in ("cpu", "tpu"):
        return False
    for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ImportError:  # a dotted name whose parent package is not installed
            pass
    return False


def xla_flags_for(existing: str, gpu: bool) -> tuple[str, list[str]]:
    """(new XLA_FLAGS, flags added): project defaults appended, the user's own settings kept."""
    if not gpu:
        return existing, []
    present = {tok.split("=")[0].lstrip("-") for tok in existing.split()}
    added = [f"--{name}={value}" for name, (value, _) in GPU_XLA_FLAGS.items() if name not in present]
    return " ".join([existing.strip()] + added).strip(), added


def configure_xla() -> list[str]:
    """Applies the defaults to os.environ["XLA_FLAGS"]; returns the flags it added."""
    if os.environ.get("RESFORMER_NO_XLA_DEFAULTS") == "1":
        return []
    flags, added = xla_flags_for(os.environ.get("XLA_FLAGS", ""), cuda_plugin_present())
    if added:
        os.environ["XLA_FLAGS"] = flags
    return added
