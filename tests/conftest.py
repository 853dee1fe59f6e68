"""Test setup: 8 host CPU devices (must be set before jax is imported)."""
import os
import pathlib

# 8 host devices to test meshes; LLVM optimisation off because compiling, not running, dominates
# these tiny programs (about 30% faster here; numerics are checked against references either way).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The project's XLA defaults, as every command sets them (runtime.py): tests compare in-process runs with
# subprocess ones bitwise, so both must compile alike.
from resformer_jax.runtime import configure_xla  # noqa: E402

configure_xla()
# XLA's CPU compiles dominate this suite; many tests (and their subprocesses) compile the same
# tiny programs, so share a persistent compilation cache.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/resformer_jax_test_jit_cache")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent: these tests need ../shared/data beside the checkout")
    return SHARED_DATA
