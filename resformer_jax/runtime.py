"""XLA settings the project sets for you, where they are known to be safe.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
import time

import resformer_jax

# flag -> (value, why)
# "PID:UNIX-TIME": the first interpreter's start, carried over the one restart (same PID) for the goodput ledger.
STARTED_ENV = "RESFORMER_INTERPRETER_STARTED"

GPU_XLA_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": (
        "true",
        "schedule FSDP all-gathers / reduce-scatters to overlap the layers' matmuls",
    ),
    "xla_gpu_enable_while_loop_double_buffering": (
        "true",
        "layers run as one nn.scan (a while loop): double-buffer it so layer n+1's weights "
        "are gathered while layer n computes",
    ),
    "xla_gpu_enable_pipelined_all_gather": ("true", "same, for the all-gather inside the scanned layers"),
    "xla_gpu_enable_pipelined_reduce_scatter": ("true", "same, for the gradient reduce-scatter"),
    "xla_gpu_enable_pipelined_all_reduce": ("true", "same, for data-parallel gradient all-reduces"),
    "xla_gpu_all_reduce_combine_threshold_bytes": (
        "134217728",
        "combine small per-parameter all-reduces into 128 MiB ones",
    ),
    "xla_gpu_all_gather_combine_threshold_bytes": ("134217728", "combine small all-gathers (128 MiB)"),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": ("67108864", "combine small reduce-scatters (64 MiB)"),
    "xla_gpu_enable_triton_gemm": ("false", "cuBLAS is faster than Triton GEMMs for these dense projections on H100"),
    "xla_gpu_nccl_termination_timeout_seconds": (
        "600",
        "a collective whose peers never join XLA's NCCL rendezvous ends the process after 10 minutes (XLA's "
        "default: never); a step stalled inside NCCL is the watchdog's (train/watchdog.py)",
    ),
}


# Set on CPU-only hosts (no CUDA plugin, no libtpu), where the installed jaxlib knows the flag.
CPU_XLA_FLAGS = {
    "xla_cpu_experimental_ynn_fusion_type": (
        "-reduce",
        "keep reductions (the LM head's logsumexp) on XLA's threaded, vectorised emitter; YNNPACK "
        "ran them on one thread, 10x slower, and stalled the next matmul",
    ),
}


def _library_knows_flag(package: str, libraries: tuple[str, ...], name: str) -> bool:
    import mmap

    try:
        spec = importlib.util.find_spec(package)
    except ImportError:
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    needle = b"\0" + name.encode() + b"\0"
    for folder in spec.submodule_search_locations:
        for lib in libraries:
            path = os.path.join(folder, lib)
            if os.path.isfile(path) and os.path.getsize(path) > (1 << 20):
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    if m.find(needle) >= 0:
                        return True
    return False


def jaxlib_knows_flag(name: str) -> bool:
    """Whether the installed jaxlib registers XLA flag `name`: an unknown flag in XLA_FLAGS aborts the process
    at start-up, and the experimental ones come and go between releases. Looks for the name in jaxlib's own
    library (memory-mapped; a few ms) without starting JAX."""
    return _library_knows_flag("jaxlib", ("libjax_common.so", "xla_extension.so", "_jax.so"), name)


def gpu_plugin_knows_flag(name: str) -> bool:
    """Whether the CUDA plugin, which parses XLA_FLAGS with its own XLA build on a GPU host, registers `name`
    (jaxlib's where no plugin library is found)."""
    for package in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            spec = importlib.util.find_spec(package)
        except ImportError:
            spec = None
        if spec is not None:
            return _library_knows_flag(package, ("xla_cuda_plugin.so",), name)
    return jaxlib_knows_flag(name)


def nvidia_driver_present() -> bool:
    """An NVIDIA driver on this host: the plugin alone (installed for `compile`: compilation/aot.py) is no GPU."""
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


def xla_flags_for(existing: str, gpu: bool, known=None, tpu: bool = False) -> tuple[str, list[str]]:
    """(new XLA_FLAGS, flags added): project defaults appended, the user's own settings kept, each only where the
    XLA that parses it knows it (`known`: the CUDA plugin's for the GPU flags, jaxlib's for the CPU ones)."""
    present = {tok.split("=")[0].lstrip("-") for tok in existing.split()}
    # An accelerator host computes on the accelerator, and its plugin (CUDA, libtpu) may parse XLA_FLAGS with
    # its own XLA build: only the GPU flags go to a GPU host, none of the CPU ones to either.
    known = known or (gpu_plugin_knows_flag if gpu else jaxlib_knows_flag)
    flags = GPU_XLA_FLAGS if gpu else {} if tpu else CPU_XLA_FLAGS
    defaults = {k: v for k, v in flags.items() if known(k)}
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


# A CPU train or eval step whose matmuls have at least this many rows (tokens per device per microbatch) runs them
# on XLA's Eigen path where the CPU has AVX2 but no AVX-512 (`cpu_step_compiler_options`).
EIGEN_STEP_MIN_ROWS = 1024


def cpu_features(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """This host's CPU feature flags (avx2, avx512f, amx_bf16, ...); empty where /proc/cpuinfo cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_step_compiler_options(
    platform: str, rows: int, features: frozenset[str] | None = None, environ=os.environ, known=jaxlib_knows_flag
) -> tuple[dict[str, str], str]:
    """(XLA compiler options for a train/eval step, why; ({}, "") where there is nothing to change).

    On an x86 CPU with AVX2 but no AVX-512, a step's large matmuls (`rows` >= EIGEN_STEP_MIN_ROWS tokens per
    device) go to XLA's Eigen path instead of YNNPACK (measured in docs/performance.md). Not on AVX-512
    CPUs (YNNPACK was the faster path there, and XLA:CPU's bf16 fast path) or others (ARM: unmeasured), not for
    fewer rows (YNNPACK multiplies 64-256-row matrices faster: decoding), not over a YNNPACK setting of the
    user's own in XLA_FLAGS, and not with RESFORMER_NO_XLA_DEFAULTS=1. Per program (jit's compiler_options),
    so the dtype probe, decoding and everything else keep the process's defaults."""
    name = "xla_cpu_experimental_ynn_fusion_type"
    if platform != "cpu" or rows < EIGEN_STEP_MIN_ROWS or environ.get("RESFORMER_NO_XLA_DEFAULTS") == "1":
        return {}, ""
    features = cpu_features() if features is None else features
    if "avx2" not in features or "avx512f" in features:
        return {}, ""  # measured on x86 AVX2 CPUs only: AVX-512 ones (and ARM, unmeasured) keep YNNPACK
    ours = f"--{name}={CPU_XLA_FLAGS[name][0]}"
    if any(tok.lstrip("-").split("=")[0] == name and tok != ours for tok in environ.get("XLA_FLAGS", "").split()):
        return {}, ""  # the user's own YNNPACK setting wins
    if not known(name):
        return {}, ""
    return {name: ""}, (
        f"matmuls on XLA's Eigen path, not YNNPACK: this CPU has AVX2 but no AVX-512 and the "
        f"step's matmuls have {rows:,} rows (>= {EIGEN_STEP_MIN_ROWS:,})"
    )


def host_memory_tunables(environ=os.environ, libc=None, thp_mode=None) -> str | None:
    """The GLIBC_TUNABLES value this CPU-only host's commands should run with, or None when there is nothing to
    change: an accelerator host, defaults off, another C library or a glibc before 2.35 (no hugetlb tunable), a
    kernel whose THP mode is not "madvise" ("always" already backs large blocks; "never" cannot), or the user's
    own hugetlb setting. `libc` and `thp_mode` are for tests (default: this process's and this kernel's)."""
    import platform

    if environ.get("RESFORMER_NO_XLA_DEFAULTS") == "1" or cuda_plugin_present() or libtpu_present():
        return None
    name, version = libc or platform.libc_ver()
    try:
        if name != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
            return None
    except ValueError:
        return None
    if thp_mode is None:
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                thp_mode = f.read().split("[")[1].split("]")[0]
        except (OSError, IndexError):
            return None
    existing = environ.get("GLIBC_TUNABLES", "")
    if thp_mode != "madvise" or "glibc.malloc.hugetlb" in existing:
        return None
    return ":".join(filter(None, [existing, "glibc.malloc.hugetlb=1"]))


# What the CUDA plugin prints while loading on a host with no NVIDIA driver (the aot extra installs it for
# `compile`): C++ log lines written straight to the process's stderr, dropped by quiet_absent_accelerators.
ABSENT_CUDA_NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog() is called")


@contextlib.contextmanager
def stderr_without(noise: tuple[str, ...]):
    """Runs the block with file descriptor 2 captured, then writes back every line that holds none of `noise`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [
                ln
                for ln in captured.read().decode(errors="replace").splitlines(keepends=True)
                if not any(n in ln for n in noise)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def quiet_absent_accelerators() -> None:
    """On a host with neither an NVIDIA driver, an AMD GPU nor a TPU chip, where the aot extra has installed the
    CUDA plugin and libtpu (for `compile`): JAX_PLATFORMS=cpu unless the user set it (the plugins would only fail
    there, with tracebacks), and JAX imported and its plugins registered with the CUDA plugin's "no driver" lines
    dropped.
    Where a GPU or TPU is present nothing changes, so nothing of theirs is hidden. The backend is not started
    (XLA_FLAGS and jax.distributed still come first)."""
    if "jax" in sys.modules or nvidia_driver_present() or tpu_chip_present() or os.path.exists("/dev/kfd"):
        return  # /dev/kfd: an AMD GPU (ROCm), which JAX_PLATFORMS=cpu would hide
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
            return
    except ImportError:
        return
    with stderr_without(ABSENT_CUDA_NOISE):
        import jax  # noqa: F401 - loads jaxlib's CUDA helpers
        from jax._src import xla_bridge

        register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
        if register is not None:  # loads the plugin itself; its absence only means one more line at start-up
            register()


def prepare_command_process() -> None:
    """What a command's process needs before it imports JAX, called by the entry point (commands/cli.run), never on
    import: on a CPU host the process restarts once with huge pages for XLA's buffers
    (`restart_with_host_memory_defaults`); on a host without GPU or TPU, the accelerator plugins the aot extra
    installs are kept quiet."""
    restart_with_host_memory_defaults()
    quiet_absent_accelerators()


def restart_with_host_memory_defaults():
    """Re-executes this process (same PID, interpreter and argv) with `host_memory_tunables()` in its environment,
    when that says so and the process is a resformer_jax command (`python -m resformer_jax.X`); otherwise returns.
    Called once, by `prepare_command_process` before any command module is imported (so before JAX); the
    restarted process finds the tunable set and goes on."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is None or not spec.name.startswith("resformer_jax."):
        return  # a library call (tests, notebooks): never replace someone else's process
    tunables = host_memory_tunables()
    if tunables is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        started = getattr(resformer_jax, "IMPORTED_UNIX", None) or time.time()  # the package's first import
        env = dict(os.environ, GLIBC_TUNABLES=tunables, **{STARTED_ENV: f"{os.getpid()}:{started}"})
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return  # no restart possible (an unusual interpreter path): the defaults are a speed-up, not a need


def configure_xla_for_target(platform: str) -> list[str]:
    """For `resformer compile`, which runs on a CPU but compiles for `platform` ('cuda', 'tpu'): the
    flags a run on that hardware gets (GPU: GPU_XLA_FLAGS; TPU: none), none of the CPU ones. Returns those added."""
    if os.environ.get("RESFORMER_NO_XLA_DEFAULTS") == "1":
        return []
    gpu = platform == "cuda"
    flags, added = xla_flags_for(os.environ.get("XLA_FLAGS", ""), gpu, tpu=not gpu)
    if added:
        os.environ["XLA_FLAGS"] = flags
    return added
