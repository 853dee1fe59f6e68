"""Test setup: 8 host CPU devices (must be set before jax is imported); under pytest-xdist (README's `-n 2`),
one compilation cache per worker and tests marked `exclusive` run with no other test beside them."""

import fcntl
import os
import pathlib

# 8 host devices to test meshes; LLVM optimisation off because compiling, not running, dominates
# these tiny programs (about 30% faster here; numerics are checked against references either way).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The project's XLA defaults, as every command sets them (runtime.py): tests compare in-process runs with
# subprocess ones bitwise, so both must compile alike.
from resformer_jax.runtime import configure_xla

configure_xla()
# XLA's CPU compiles dominate this suite; many tests (and their subprocesses) compile the same
# tiny programs, so share a persistent compilation cache. One per xdist worker: JAX writes an entry in place
# (no lock unless the cache has a size limit), and a worker reading another's half-written entry would print
# a warning into the stderr of a command whose one-line error a test checks.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_CACHE = "/tmp/resformer_jax_test_jit_cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", f"{_CACHE}/{_WORKER}" if _WORKER else _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent: these tests need ../shared/data beside the checkout")
    return SHARED_DATA


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist every test holds a shared lock from its setup (module fixtures included) to its teardown; one
    marked `exclusive` takes it exclusively, so the timings it compares are not taken while the other worker
    compiles. The gate stops new tests from starting while an exclusive one waits for the running ones to finish
    (flock alone would let them starve it)."""
    if not _WORKER:
        yield
        return
    folder = pathlib.Path(item.config.option.basetemp).parent  # this run's base temp, shared by its workers
    lock = fcntl.LOCK_EX if item.get_closest_marker("exclusive") else fcntl.LOCK_SH
    with open(folder / "gate", "a") as gate, open(folder / "running", "a") as running:  # closing unlocks
        fcntl.flock(gate, lock)
        fcntl.flock(running, lock)
        if lock == fcntl.LOCK_SH:
            fcntl.flock(gate, fcntl.LOCK_UN)  # an exclusive test may queue at the gate now
        yield


def pytest_collection_modifyitems(config, items):
    """A test that compares timings is slow too: the fast tier (-m "not slow") leaves it out."""
    for item in items:
        if item.get_closest_marker("exclusive") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
