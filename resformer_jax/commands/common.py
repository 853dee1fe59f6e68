"""What every command does first and last: XLA defaults before JAX starts, quiet library logs,
and a user's mistake (any `UserError`, or a file the system refuses) turned into one line on stderr
and an exit code, never a traceback.

  from resformer_jax.commands import common
  def main(argv):
      common.start()
      with common.exit_on_user_error():
          ...
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import inspect
import logging
import os
import sys
import tempfile
import threading
import traceback
from typing import NoReturn

from resformer_jax.errors import EXIT_USER_ERROR, UserError


def start():
    """Sets the project's XLA defaults (before JAX starts its backend) and quiets absl's INFO logs
    (orbax and grain log every step at INFO)."""
    from resformer_jax.runtime import configure_xla

    configure_xla()
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)


def report_user_error(e: BaseException) -> int:
    """One line on stderr for a UserError (its message) or an OSError (the path and what to check); the exit code."""
    if isinstance(e, OSError):
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(
            f"error: {e.strerror or e}{where}; check the path, its permissions and the free space "
            "(a read-only or full disk, or a missing folder)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_USER_ERROR
    print(f"error: {e}", file=sys.stderr, flush=True)
    return getattr(e, "exit_code", EXIT_USER_ERROR)


def fail(message: str) -> NoReturn:
    """The one line a command ends with where its input cannot work, and the exit code that says so."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


@contextlib.contextmanager
def exit_on_user_error():
    """Runs the block; a user error (or a file the system refuses) prints its one-line message and exits
    with its code."""
    try:
        yield
    except (UserError, OSError) as e:
        sys.exit(report_user_error(e))


class ConfigFlagError(UserError, ValueError):
    """A --config file or --config.field flag that cannot work; the message says what to change."""


def load_config_file(path: str):
    """The ConfigDict a config file's get_config() returns; ConfigFlagError for a missing file, a syntax
    error, an error while it runs, or no get_config()."""
    arg = None
    if not os.path.isfile(path) and ":" in path and os.path.isfile(path.rsplit(":", 1)[0]):
        path, arg = path.rsplit(":", 1)  # ml_collections' FILE:ARGUMENT form, passed to get_config(ARGUMENT)
    mod = load_config_module(path)
    try:
        return mod.get_config() if arg is None else mod.get_config(arg)
    except Exception as e:
        raise ConfigFlagError(f"--config {path}: get_config() fails ({type(e).__name__}: {e}); fix the file") from None


def load_config_module(path: str):
    """A config file's module, its get_config() checked present; ConfigFlagError for a missing file, a syntax error
    or an error while it runs."""
    if not os.path.isfile(path):
        raise ConfigFlagError(f"--config file {path!r} does not exist; give a file like configs/resformer_82m.py")
    spec = importlib.util.spec_from_file_location("_resformer_config", path)
    assert spec is not None and spec.loader is not None  # a .py file that exists
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except SyntaxError as e:
        raise ConfigFlagError(f"--config {path}: syntax error at line {e.lineno}: {e.msg}; fix the file") from None
    except Exception as e:
        raise ConfigFlagError(f"--config {path} fails while loading ({type(e).__name__}: {e}); fix the file") from None
    if not callable(getattr(mod, "get_config", None)):
        raise ConfigFlagError(f"--config {path} has no get_config() function; define one returning a ConfigDict")
    return mod


def check_config_flags(argv: list[str], default_config: str | None = None, name: str = "config"):
    """Checks --config and every --config.a.b flag before absl parses them (absl's own errors are tracebacks
    from deep inside ml_collections): a missing or broken file, an unknown field (with the closest names),
    a value of the wrong type. Exits 2 with one line on the first problem."""
    from resformer_jax.config import MissingField, get_dotted

    path, fields = default_config, []
    args = list(argv[1:])
    for i, a in enumerate(args):
        if a == f"--{name}" and i + 1 < len(args):
            path = args[i + 1]
        elif a.startswith(f"--{name}="):
            path = a.split("=", 1)[1]
        elif a.startswith(f"--{name}."):
            field, _, value = a[len(name) + 3 :].partition("=")
            if not _ and i + 1 < len(args):
                value = args[i + 1]
            fields.append((field, value))
    try:
        if path is None:
            if fields:
                raise ConfigFlagError(f"--{name}.{fields[0][0]} given without --{name}=FILE")
            return
        cfg = load_config_file(path)
        for field, value in fields:
            try:
                current = get_dotted(cfg, field)
            except MissingField as e:
                close = difflib.get_close_matches(e.part, e.fields, n=3)
                raise ConfigFlagError(
                    f"--{name}.{field}: {e.parent or 'the config'} has no field {e.part!r}"
                    + (f"; did you mean {', '.join(close)}?" if close else f"; its fields: {', '.join(e.fields)}")
                ) from None
            _check_type(f"--{name}.{field}", value, current)
    except ConfigFlagError as e:
        fail(str(e))


def _check_type(flag: str, value: str, current):
    kind = type(current)
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError
        elif kind is int:
            int(value)
        elif kind is float:
            float(value)
    except ValueError:
        expected = {bool: "true or false", int: "an integer", float: "a number"}[kind]
        raise ConfigFlagError(f"{flag}={value!r}: expected {expected}") from None


class _LibraryErrorFile:
    """Where library errors go instead of the console: RUN/library_errors.log (or a temp file). On object
    storage, which cannot append, a file per process rewritten whole (errors are rare)."""

    def __init__(self, workdir: str):
        from etils import epath

        from resformer_jax import storage
        from resformer_jax.rundir import RunDir

        self._epath, self._is_remote = epath.Path, storage.is_remote  # bound now: writes may come at shutdown
        self.candidates = [os.path.join(tempfile.gettempdir(), f"resformer_jax_library_errors_{os.getpid()}.log")]
        try:
            log = RunDir(workdir).library_errors_log
        except UserError:  # an unusable path: the command reports it; errors go to the temp file meanwhile
            log = None
        if log is not None and not storage.is_remote(workdir):
            self.candidates.insert(0, os.fspath(log))
        elif log is not None:  # object storage cannot append: a file per process
            self.candidates.insert(0, f"{os.fspath(log.parent).rstrip('/')}/{log.stem}-{os.getpid()}{log.suffix}")
        self.path: str | None = None
        self.text = ""

    def write(self, text: str):
        text = text if text.endswith("\n") else text + "\n"
        for path in [self.path] if self.path else self.candidates:
            try:
                if self._is_remote(path):
                    self._epath(path).write_text(self.text + text)
                else:
                    with open(path, "a") as f:
                        f.write(text)
                self.text += text
                self.path = path
                return
            except Exception:
                continue


def divert_library_errors(workdir: str) -> _LibraryErrorFile:
    """Errors that libraries log from their own threads (orbax's asynchronous writers, asyncio) go to a file
    instead of the console, where they would bury the one line that says what happened; that line points to
    the file. Warnings stay on the console."""
    sink = _LibraryErrorFile(workdir)

    class Divert(logging.Filter):
        def filter(self, record):
            if record.levelno >= logging.ERROR and record.name.split(".")[0] in ("absl", "asyncio", "orbax"):
                sink.write(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s").format(record))
                return False
            return True

    for h in logging.getLogger().handlers + logging.getLogger("absl").handlers:
        h.addFilter(Divert())

    def thread_hook(args):
        sink.write("".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))

    threading.excepthook = thread_hook

    def unraisable_hook(u):
        with contextlib.suppress(Exception):
            sink.write(
                f"{u.err_msg or 'unraisable'}: "
                + "".join(traceback.format_exception(type(u.exc_value), u.exc_value, u.exc_traceback))
            )

    sys.unraisablehook = unraisable_hook
    return sink


HELP_FLAGS = ("--help", "-h", "--helpshort", "-?", "--help=true")


def command_help(module) -> str:
    """A command's --help: its docstring, then each flag it defines with its help and default (absl's own --help
    lists only the flags of the program's __main__ module, which for `resformer COMMAND` is the dispatcher)."""
    from absl import flags

    doc = inspect.cleandoc(module.__doc__ or "")
    by_module = flags.FLAGS.flags_by_module_dict()
    names = [m for m in by_module if m in (module.__name__, getattr(module, "__file__", None), sys.argv[0])]
    listing = "\n".join(flags.FLAGS.module_help(m).split("\n", 2)[-1] for m in names if by_module[m])
    return f"{doc}\n\nflags:\n{listing.rstrip()}\n" if listing.strip() else f"{doc}\n\n(no flags)\n"


def run_app(main, module) -> None:
    """absl's app.run(main), with `--help` (and -h, --helpshort) answered from `module`'s own flags, exit 0, and a
    flag absl cannot parse or a usage error in one line with exit 2 (absl adds its usage and exits 1)."""
    from absl import app, flags

    if any(a in HELP_FLAGS for a in sys.argv[1:]):
        sys.stdout.write(command_help(module))
        sys.exit(0)
    command = module.__name__.rsplit(".", 1)[-1].replace("main", "train")

    def refuse(e: Exception):
        print(f"error: {e}; resformer {command} --help lists its flags", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)

    def parse_flags(argv):
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            refuse(e)

    def main_or_usage_error(argv):
        try:
            return main(argv)
        except app.UsageError as e:
            refuse(e)

    app.run(main_or_usage_error, flags_parser=parse_flags)
