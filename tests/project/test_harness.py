"""The suite's own harness (tests/conftest.py) under README's command: a worker that crashes once in a test runs it
again in a fresh worker and the run passes, saying so; a test that crashes every time fails the run, which ends; a
worker past half the kernel's map limit drops JAX's caches."""

import itertools
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

CRASHING_TESTS = """
import os, pathlib, pytest

@pytest.mark.parametrize("i", range(6))
def test_before(i):  # units each worker finishes before the crash: xdist 3.8 queued them again, handing out nothing
    pass

@pytest.mark.parametrize("times", [{times}])
def test_crashes(times, tmp_path_factory):
    count = pathlib.Path(os.environ["CRASH_COUNT_FILE"])
    crashed = len(count.read_text()) if count.exists() else 0
    if crashed < times:
        count.write_text("x" * (crashed + 1))
        os.kill(os.getpid(), 11)

@pytest.mark.xdist_group("group")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    pass
"""


def _run_suite_with_a_crashing_test(tmp_path, times):
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_crash.py").write_text(CRASHING_TESTS.format(times=times))
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(PYTHONPATH=str(ROOT), CRASH_COUNT_FILE=str(tmp_path / "crashes"))
    try:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-o", f"addopts={addopts}",
             "--rootdir", str(tmp_path), str(tmp_path)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the run hung after the crash (tests/conftest.py CrashedOnce):\n{(e.stdout or b'')[-3000:]!r}")


@pytest.mark.slow
def test_a_worker_crash_reruns_the_test_once_and_a_second_crash_fails_the_run(tmp_path):
    (tmp_path / "once").mkdir()
    once = _run_suite_with_a_crashing_test(tmp_path / "once", 1)
    assert once.returncode == 0, once.stdout[-3000:]
    assert "11 passed, 1 rerun" in once.stdout, once.stdout[-3000:]
    assert "test_crash.py::test_crashes[1]: ran again in a fresh worker" in once.stdout
    assert "Fatal Python error: Segmentation fault" in once.stdout + once.stderr  # the worker's stack is in the log

    (tmp_path / "always").mkdir()
    always = _run_suite_with_a_crashing_test(tmp_path / "always", 99)
    assert always.returncode == 1, always.stdout[-3000:]
    assert "FAILED test_crash.py::test_crashes[99]" in always.stdout, always.stdout[-3000:]
    assert "test_crash.py::test_crashes[99]: failed" in always.stdout


MAP_TESTS = """
import jax, jax.numpy as jnp, pytest, conftest

BASE = conftest._memory_maps()
conftest.MAPS_BEFORE_CLEARING = BASE + 600  # the kernel's limit stands in: 65,530 would take thousands of compiles
KEPT = []  # functions that live on, as a module's jitted functions do: JAX's caches keep their executables

@pytest.mark.parametrize("i", range(8))
def test_compiles(i):
    for k in range(60):  # 60 programs: about 180 mappings
        KEPT.append(jax.jit(lambda x, k=k: jnp.sin(x) * k + jnp.cos(x) ** i))
        KEPT[-1](jnp.ones(k + 1)).block_until_ready()
    with open("maps.txt", "a") as f:
        f.write(f"{BASE} {conftest._memory_maps()}\\n")
"""


@pytest.mark.slow
def test_a_worker_past_half_the_map_limit_drops_jaxs_caches_between_tests(tmp_path):
    """Every executable XLA:CPU keeps maps its code; at vm.max_map_count the next compile dies (a segmentation fault).
    Past MAPS_BEFORE_CLEARING the harness drops JAX's caches after the test: the mappings fall back, and never climb
    more than one test's worth past the line (without it, 8 tests x 60 programs: 1,716 past the start, measured)."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_maps.py").write_text(MAP_TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(PYTHONPATH=str(ROOT), JAX_ENABLE_COMPILATION_CACHE="false")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp_path),
         str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    rows = [tuple(map(int, line.split())) for line in (tmp_path / "maps.txt").read_text().splitlines()]
    base, after = rows[0][0], [a for _, a in rows]
    assert len(after) == 8 and max(after) - base < 600 + 400, after  # the line, plus one test's programs
    assert any(b < a for a, b in itertools.pairwise(after)), after  # dropped: the caches were cleared
