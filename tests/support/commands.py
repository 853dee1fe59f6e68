"""`resformer COMMAND ...` called in this test process, for tests that read what a command wrote or printed and are not
about the process boundary (exit codes of a fresh interpreter, signals and the restart stay subprocess tests).

In-process, the command reuses the compiles this process already holds and pays no interpreter start. Its absl flags
are global: two commands define --workdir, so only the called command's flags are registered while it runs, each
command's own Flag objects kept aside between calls (absl refuses a second definition of a name)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import pathlib
import sys

from absl import flags
from ml_collections import config_flags

from resformer_jax.commands.cli import COMMANDS

ROOT = pathlib.Path(__file__).resolve().parents[2]
_MODULES = {command: f"resformer_jax.commands.{module}" for command, module, _ in COMMANDS}


@dataclasses.dataclass(frozen=True)
class Result:
    """What subprocess.run(..., capture_output=True, text=True) gives, for the same asserts."""

    returncode: int
    stdout: str
    stderr: str


class _CommandFlags:
    """Each command module's own flags, registered in absl's FLAGS only while that command runs."""

    def __init__(self):
        self.by_module: dict[str, list[flags.Flag]] = {}

    def _unregister_all(self):
        names = set()
        for defined in self.by_module.values():
            for flag in defined:
                names.add(flag.name)
                if flag.name in flags.FLAGS and flags.FLAGS[flag.name] is flag:
                    delattr(flags.FLAGS, flag.name)
        for name in list(flags.FLAGS):  # a config file flag's per-field overrides, defined as it was parsed
            if "." in name and name.split(".", 1)[0] in names:
                delattr(flags.FLAGS, name)

    def activate(self, module_name: str):
        """Imports the command module with no other command's flags registered, then registers only its flags."""
        for name in list(sys.modules):  # commands a test imported directly, before any call here
            if name in _MODULES.values() and name not in self.by_module:
                self.by_module[name] = list(flags.FLAGS.flags_by_module_dict().get(name, []))
        self._unregister_all()
        if module_name not in self.by_module:
            importlib.import_module(module_name)
            self.by_module[module_name] = list(flags.FLAGS.flags_by_module_dict().get(module_name, []))
        for flag in self.by_module[module_name]:
            if flag.name not in flags.FLAGS:
                flags.FLAGS[flag.name] = flag
        flags.FLAGS.unparse_flags()  # the defaults again: nothing left from an earlier call


_FLAGS = _CommandFlags()


def run_command(command: str, *argv: str) -> Result:
    """`resformer COMMAND ARGV...` here, in the repository's root (as the subprocess tests run it: relative
    paths such as configs/tiny.py): its exit status and what it printed to stdout and stderr."""
    from resformer_jax.commands import cli

    _FLAGS.activate(_MODULES[command])
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    code: int | str | None = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            os.chdir(ROOT)
            cli.run(command, [str(a) for a in argv])
        except SystemExit as e:
            code = e.code
        finally:
            sys.argv = saved_argv
            os.chdir(saved_cwd)
    if code is None:
        code = 0
    elif isinstance(code, str):  # sys.exit("message"): printed, status 1
        err.write(code + "\n")
        code = 1
    return Result(code, out.getvalue(), err.getvalue())


def command_flags(module_name: str) -> frozenset[str]:
    """`--NAME` of every flag command module `module_name` (resformer_jax.commands.X) accepts: its own, as
    run_command registers them, and absl's (--help, --flagfile, logging's)."""
    _FLAGS.activate(module_name)  # absl's module table forgets a flag once unregistered: the kept Flag objects
    by_module = flags.FLAGS.flags_by_module_dict()
    absl_own = [f for m, defined in by_module.items() if m.startswith("absl.") for f in defined]
    return frozenset("--" + f.name for f in [*_FLAGS.by_module[module_name], *absl_own])


def multiprocess_env(processes: int = 2) -> dict[str, str]:
    """The environment of a test's `launch/local_multiprocess.sh PROCESSES ...`: 2 CPU devices a process, this
    process's XLA flags (the launcher appends the device count) and a compilation cache shared by every launch of
    that layout, beside the suite's: JAX's cache key leaves the device count out, so a single process must never read
    a program compiled for several (a launch's programs compiled once a layout, not once a test)."""
    devices = 2
    single = os.environ.get("JAX_COMPILATION_CACHE_DIR", "/tmp/resformer_jax_test_jit_cache").rstrip("/")
    return dict(
        os.environ,
        PYTHON=sys.executable,
        DEVICES_PER_PROCESS=str(devices),
        JAX_COMPILATION_CACHE_DIR=f"{single}_{processes}_processes_of_{devices}_devices",
    )


def parsed_config_flag(argv: list[str], default: str | None = None):
    """The `--config` flag of `argv` as absl parses it in a FlagValues of its own, --config.* overrides applied."""
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", default, flag_values=values, lock_config=True)
    saved, sys.argv = sys.argv, argv  # ml_collections finds the --config.* overrides in sys.argv
    try:
        values(argv)
    finally:
        sys.argv = saved
    return values["config"]
