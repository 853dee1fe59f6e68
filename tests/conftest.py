"""Test setup: 8 host CPU devices (must be set before jax is imported); one compilation cache for every process of
the run; under pytest-xdist (README's `-n 2`), tests marked `exclusive` run with no other test beside them."""

import fcntl
import os
import pathlib
import subprocess
import sys

# 8 host devices to test meshes; compiling, not running, dominates these tiny programs, so LLVM's optimisation
# is off and XLA:CPU's elemental fusion emitters replace its fusion emitters (each a cut of the suite's time,
# docs/architecture.md; numerics are checked against references either way). A test that compares two different
# programs bitwise runs under XLA's own emitters instead: mark it `xla_emitters` (pytest_pyfunc_call below).
FAST_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 {FAST_EMITTERS}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The project's XLA defaults, as every command sets them (runtime.py): tests compare in-process runs with
# subprocess ones bitwise, so both must compile alike.
from resformer_jax.runtime import configure_xla  # noqa: E402

configure_xla()
# XLA's CPU compiles dominate this suite; many tests (and their subprocesses) compile the same
# tiny programs, so both workers and every subprocess share one persistent compilation cache, every compile kept
# (the eager ops' too: sharing them beats leaving them out). No size limit: with one, JAX lists and reads every
# entry's files at each write, under a lock both workers wait on: a cost growing with the cache (docs/architecture.md).
# A read of an entry another process is still writing fails its decompression: JAX warns and compiles.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/resformer_jax_test_jit_cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Nothing in the suite downloads: lm-eval's local tasks and the Hugging Face tests read files beside the checkout.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    """Tiny runs trained once a session whatever asks for them (tests/support/shared_runs.py), in a folder both
    pytest-xdist workers see: the session's base temp."""
    from shared_runs import SharedRuns

    base = tmp_path_factory.getbasetemp()
    return SharedRuns((base.parent if _WORKER else base) / "shared_runs")


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


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked `xla_emitters` asserts that two different programs agree bitwise (a step with spike skipping on
    and the plain one; a forked cooldown and a switched schedule): the elemental emitters this suite compiles with
    fuse such programs differently, XLA's own fusion emitters (what a user runs) alike. So the test runs in a fresh
    pytest process without the suite's emitter flag; its failure output is this test's."""
    flags_now = os.environ.get("XLA_FLAGS", "")
    if not pyfuncitem.get_closest_marker("xla_emitters") or FAST_EMITTERS not in flags_now.split():
        return None
    nodeid = pyfuncitem.nodeid.split("@")[0] if pyfuncitem.get_closest_marker("xdist_group") else pyfuncitem.nodeid
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["XLA_FLAGS"] = " ".join(f for f in flags_now.split() if f != FAST_EMITTERS)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", nodeid],
        cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if r.returncode != 0:
        why = f"{nodeid} failed under XLA's own fusion emitters (a fresh pytest):\n{r.stdout[-6000:]}{r.stderr[-2000:]}"
        pytest.fail(why, pytrace=False)
    return True


def pytest_collection_modifyitems(config, items):
    """A test that compares timings is slow too: the fast tier (-m "not slow") leaves it out. The files holding slow
    tests go first, each kept whole (its module fixtures built once): under -n 2 the long tests start early instead
    of one ending the run while the other worker idles."""
    for item in items:
        if item.get_closest_marker("exclusive") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
    if hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False):  # an xdist worker
        _name_xdist_groups(items)


def _name_xdist_groups(items):
    """--dist loadgroup sends the tests whose ids end in @GROUP to one worker. pytest-xdist (3.8) appends it by setting
    item._nodeid, which pytest 9.2 no longer reads (the id is item._id): every grouped file was split over both
    workers, its module fixtures (trained runs, emulators) built twice. Appended here where xdist's did not take."""
    from _pytest.nodeid import coerce_node_id

    for item in items:
        group = "_".join(sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                                 for m in item.iter_markers("xdist_group")}))  # fmt: skip
        if group and not item.nodeid.endswith(f"@{group}") and hasattr(item, "_id"):
            item._id = coerce_node_id(f"{item.nodeid}@{group}")


# A fast-tier test (not marked slow) whose call takes longer than this is named at the end of the run, and fails a
# fast-tier run (-m "not slow"): mark it slow with the reason, or make it cheaper. Its call alone: a module fixture's
# setup is shared by the module's tests, whichever runs first.
FAST_TIER_LIMIT_S = 5.0


class FastTierClock:
    """Each fast-tier test's call time (under xdist the reports reach the controller too)."""

    def __init__(self, config):
        self.config, self.spent = config, {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and "slow" not in report.keywords:
            self.spent[report.nodeid] = self.spent.get(report.nodeid, 0.0) + report.duration

    def over(self):
        return sorted(((t, n) for n, t in self.spent.items() if t > FAST_TIER_LIMIT_S), reverse=True)

    def pytest_sessionfinish(self, session, exitstatus):
        fast_tier = (self.config.option.markexpr or "").replace(" ", "") == "notslow"
        if fast_tier and self.over() and exitstatus == 0:
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter):
        if self.over():
            terminalreporter.section(
                f"fast-tier tests over {FAST_TIER_LIMIT_S:g} s (mark them slow, or make them cheaper)"
            )
            for t, name in self.over():
                terminalreporter.write_line(f"{t:6.1f} s  {name}")


class CrashedOnce:
    """A worker that dies in a test (a segmentation fault: XLA past the kernel's map limit, see MAPS_BEFORE_CLEARING;
    or any other native crash) is replaced and the test run again: the
    first crash of a test is reported as a rerun; a second crash of the same test, or a crash past pyproject's
    `--max-worker-restart=4`, fails the run (a test that always crashes: five tries, then the run ends). Each crash
    is named at the end of the run, with the worker's stack (pytest's faulthandler) above it in the log."""

    def __init__(self, config):
        restarts = config.getoption("maxworkerrestart", None)  # xdist's default where unset: 4 per worker
        self.restarts = int(restarts) if restarts is not None else 4 * int(config.getoption("numprocesses") or 0)
        self.crashed = []
        self.replacements_get_two_units = False

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem, report, sched):
        # pytest-xdist 3.8's loadgroup hangs the run here in two ways (tests/project/test_harness.py has both). It
        # queues the dead worker's finished units again with its unfinished ones: the replacement is handed a
        # finished one (nothing to run) and never asks for more. And it hands the replacement one unit: a worker holds
        # its last test until it has another or is told to stop, so a unit of one test waits forever once no other
        # worker is left. Its first schedule gives each worker two units for this reason; so does its replacement's.
        queue = getattr(sched, "workqueue", None)
        if queue is not None:
            for scope in [scope for scope, unit in queue.items() if all(unit.values())]:
                del queue[scope]
            if not self.replacements_get_two_units:
                schedule = sched.schedule
                sched.schedule = lambda: (schedule(), schedule())
                self.replacements_get_two_units = True
        # Past the restarts allowed xdist stops the run, the test's rerun not guaranteed: then it stays a failure.
        rerun = crashitem not in [name for name, _ in self.crashed] and len(self.crashed) < self.restarts
        if rerun:
            report.outcome = "rerun"
        self.crashed.append((crashitem, "ran again in a fresh worker" if rerun else "failed"))

    def pytest_report_teststatus(self, report):
        if report.outcome == "rerun":
            return "rerun", "R", ("RERUN", {"yellow": True})
        return None

    def pytest_terminal_summary(self, terminalreporter):
        if self.crashed:
            terminalreporter.section("tests whose worker crashed ('Fatal Python error' above: the stack)", yellow=True)
            for name, outcome in self.crashed:
                terminalreporter.write_line(f"{name}: {outcome}")


def _memory_maps(path: str = "/proc/self/maps") -> int:
    """How many memory mappings this process holds (0 where /proc cannot tell)."""
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _map_limit(path: str = "/proc/sys/vm/max_map_count") -> int:
    try:
        return int(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return 65530  # Linux's default


# Each executable XLA:CPU compiles or loads from the cache maps its code (about 3 mappings), and a worker keeps every
# one in JAX's caches: a whole-suite worker passed 24,000 in 9 minutes. At the kernel's limit (vm.max_map_count,
# 65,530 by default) the next map fails inside XLA, a segmentation fault. Past half of it, the worker drops JAX's
# caches between tests (the persistent cache still holds the programs).
MAPS_BEFORE_CLEARING = _map_limit() // 2


def pytest_runtest_teardown(item, nextitem):
    if "jax" in sys.modules and _memory_maps() > MAPS_BEFORE_CLEARING:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) gathers the reports
        config.pluginmanager.register(FastTierClock(config), "fast_tier_clock")
        if config.pluginmanager.hasplugin("xdist"):
            config.pluginmanager.register(CrashedOnce(config), "crashed_once")
