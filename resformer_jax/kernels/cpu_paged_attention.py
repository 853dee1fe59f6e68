"""The CPU's paged decode attention as native code: cpu_paged_attention.cc, an XLA FFI custom call that reads each
row's pages where they lie, K once then V once, over XLA's intra-op threads, at about the speed the CPU reads memory
(XLA's own loop over blocks of pages gathers at 7-9 GB/s; docs/evaluation.md has both measured).

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.cc")
TARGET = "resformer_paged_decode_attention"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


class NativeKernelUnavailable(RuntimeError):
    """The native kernel cannot be built or loaded here; the message says why and what to do."""


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + platform.machine()
    keep = [x for x in lines if x.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(keep)))


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise NativeKernelUnavailable("no C++ compiler found (set $CXX, or install g++)")


def cache_dir() -> Path:
    root = os.environ.get("RESFORMER_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "resformer_jax"


def build() -> Path:
    """The kernel's shared library for this machine, compiled once into the cache (an atomic rename, so processes
    building at once each leave a whole file). NativeKernelUnavailable says why it cannot be."""
    import jaxlib

    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeKernelUnavailable(f"the C++ compiler {cxx} does not run: {e}") from None
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), jaxlib.__version__, version, " ".join(FLAGS), _cpu_identity()]).encode()
    ).hexdigest()[:16]
    out = cache_dir() / f"cpu_paged_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise NativeKernelUnavailable(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    except subprocess.TimeoutExpired:
        raise NativeKernelUnavailable(f"{' '.join(cmd)} ran past 10 minutes") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the native paged decode attention: %s", out)
    return out


@functools.cache
def load() -> str | None:
    """Registers the kernel with XLA once a process; None (and the reason logged once) where it cannot be."""
    if os.environ.get("RESFORMER_NATIVE_KERNELS", "1") == "0":
        log.info("RESFORMER_NATIVE_KERNELS=0: the CPU decode attention is XLA's loop over blocks of pages")
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
    except (NativeKernelUnavailable, OSError) as e:
        log.warning("the native CPU decode attention is unavailable, so XLA's slower loop runs instead: %s", e)
        return None
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.ResformerPagedDecodeAttention), platform="cpu")
    return TARGET


def available() -> bool:
    return load() is not None


def paged_decode_attention(q_BxHxD, k_pool, v_pool, table_BxP, lengths_B):
    """softmax(q k^T / sqrt(D)) v over each row's first lengths_B tokens of pages-major pools [pages, page_size,
    K * D] (fp32 or bf16; D a multiple of 8), natively: [B, H, D] in q's dtype. A row whose table names a page
    outside the pool is an error, never a read out of bounds."""
    target = load()
    if target is None:
        raise NativeKernelUnavailable("the native CPU decode attention could not be built; see the warning above")
    q32 = q_BxHxD.astype(jnp.float32) / math.sqrt(q_BxHxD.shape[-1])
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q_BxHxD.shape, jnp.float32))
    out = call(q32, k_pool, v_pool, table_BxP.astype(jnp.int32), lengths_B.astype(jnp.int32))
    return out.astype(q_BxHxD.dtype)
