"""XLA settings the project sets for you, where they are known to be safe.

Every entry point (train, bench, generate, evaluate) calls `configure_xla()`
before JAX starts its backend. A flag you already put in XLA_FLAGS is never
overridden; RESFORMER_NO_XLA_DEFAULTS=1 turns all of this off.

GPU (set when a CUDA plugin for JAX is installed and an NVIDIA driver is present: the `aot` extra installs
the plugin on CPU machines too, to compile for GPUs): the flags MaxText runs
H100 training with, minus the ones that trade memory for speed blindly.
Each is about overlapping communication with the scanned layers' compute,
or about picking the faster GEMM path; none changes numerics beyond the
summation order of collectives.

CPU-only hosts (no CUDA plugin with a driver, no libtpu with a chip): row reductions stay with XLA's own
emitter instead of YNNPACK
(`xla_cpu_experimental_ynn_fusion_type=-reduce`, set only where the installed
jaxlib knows the flag). XLA 0.10 hands the LM head's logsumexp (an exp fused
into a sum over 50,277 logits) to YNNPACK, which ran it on one thread at
~450 ms per 1,024-position block of the 82M step, plus a ~350 ms stall before
the next matmul; XLA's emitter does the same reduction in ~40 ms. Matmuls stay
with YNNPACK (faster than Eigen at these shapes). The other XNNPACK/oneDNN
paths were measured on the 82M step's attention and were no faster.

TPU: nothing; libtpu's defaults already overlap collectives and its flags
cannot be checked without a TPU.
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


# Set on CPU-only hosts (no CUDA plugin, no libtpu), where the installed jaxlib knows the flag.
CPU_XLA_FLAGS = {
    "xla_cpu_experimental_ynn_fusion_type": (
        "-reduce", "keep reductions (the LM head's logsumexp) on XLA's threaded, vectorised emitter; YNNPACK "
                   "ran them on one thread, 10x slower, and stalled the next matmul"),
}


def jaxlib_knows_flag(name: str) -> bool:
    """Whether the installed jaxlib registers XLA flag `name`: an unknown flag in XLA_FLAGS aborts the process
    at start-up, and the experimental ones come and go between releases. Looks for the name in jaxlib's own
    library (memory-mapped; a few ms) without starting JAX."""
    import mmap
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return False
    needle = b"\0" + name.encode() + b"\0"
    for folder in spec.submodule_search_locations:
        for lib in ("libjax_common.so", "xla_extension.so", "_jax.so"):
            path = os.path.join(folder, lib)
            if os.path.isfile(path) and os.path.getsize(path) > (1 << 20):
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    if m.find(needle) >= 0:
                        return True
    return False


def nvidia_driver_present() -> bool:
    """An NVIDIA driver on this host: the plugin alone (installed for `compile`, train/aot.py) computes nothing."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def tpu_chip_present() -> bool:
    """TPU chips on this host (v4: /dev/accel*, v5e and later: /dev/vfio/N), or a TPU VM's environment."""
    import glob
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or os.environ.get("TPU_ACCELERATOR_TYPE"))


def cuda_plugin_present() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() in ("cpu", "tpu"):
        return False
    if not nvidia_driver_present():
        return False
    for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ImportError:  # a dotted name whose parent package is not installed
            pass
    return False


def libtpu_present() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() in ("cpu", "cuda", "gpu"):
        return False
    if not tpu_chip_present():
        return False
    try:
        return importlib.util.find_spec("libtpu") is not None
    except ImportError:
        return False


def xla_flags_for(existing: str, gpu: bool, known=jaxlib_knows_flag, tpu: bool = False) -> tuple[str, list[str]]:
    """(new XLA_FLAGS, flags added): project defaults appended, the user's own settings kept."""
    present = {tok.split("=")[0].lstrip("-") for tok in existing.split()}
    # An accelerator host computes on the accelerator, and its plugin (CUDA, libtpu) may parse XLA_FLAGS with
    # its own XLA build: only the GPU flags go to a GPU host, none of the CPU ones to either.
    defaults = GPU_XLA_FLAGS if gpu else {} if tpu else {k: v for k, v in CPU_XLA_FLAGS.items() if known(k)}
    added = [f"--{name}={value}" for name, (value, _) in defaults.items() if name not in present]
    if not added:
        return existing, []
    return " ".join([existing.strip()] + added).strip(), added


def configure_xla() -> list[str]:
    """Applies the defaults to os.environ["XLA_FLAGS"]; returns the flags it added."""
    if os.environ.get("RESFORMER_NO_XLA_DEFAULTS") == "1":
        return []
    flags, added = xla_flags_for(os.environ.get("XLA_FLAGS", ""), cuda_plugin_present(), tpu=libtpu_present())
    if added:
        os.environ["XLA_FLAGS"] = flags
    return added


def configure_xla_for_target(platform: str) -> list[str]:
    """For `python -m resformer_jax.compile`, which runs on a CPU but compiles for `platform` ('cuda', 'tpu'): the
    flags a run on that hardware gets (GPU: GPU_XLA_FLAGS; TPU: none), none of the CPU ones. Returns those added."""
    if os.environ.get("RESFORMER_NO_XLA_DEFAULTS") == "1":
        return []
    gpu = platform == "cuda"
    flags, added = xla_flags_for(os.environ.get("XLA_FLAGS", ""), gpu, tpu=not gpu)
    if added:
        os.environ["XLA_FLAGS"] = flags
    return added
