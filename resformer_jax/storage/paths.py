"""Which paths a run can use: local, gs:// or s3:// (with the client package installed), as epath paths."""

from __future__ import annotations

import importlib.util
import os
import sys

from etils import epath

from resformer_jax.errors import UserError

# scheme -> (modules it needs, the pip extra that installs them)
_CLOUD_PACKAGES = {
    "gs": (("gcsfs",), "gcs"),
    "s3": (("s3fs",), "s3"),
}


class StorageError(UserError, ValueError):
    """A run path this installation cannot use; the message names the package and the extra."""


def scheme(path) -> str:
    """'gs', 's3', ... for a URL; '' for a local path."""
    s = os.fspath(path) if not isinstance(path, str) else path
    return s.split("://", 1)[0] if "://" in s else ""


def is_remote(path) -> bool:
    return scheme(path) != ""


def check_supported(path) -> None:
    """Raises StorageError naming the extra to install when `path`'s scheme needs a missing package."""
    sch = scheme(path)
    if not sch:
        return
    if sch not in _CLOUD_PACKAGES:
        raise StorageError(f"{path}: {sch}:// is not supported; use a local path, gs:// or s3://")
    modules, extra = _CLOUD_PACKAGES[sch]
    missing = [m for m in modules if not _importable(m)]
    if missing:
        raise StorageError(
            f"{path} needs {' and '.join(missing)} for {sch}:// paths; install them with "
            f"pip install -e '.[{extra}]' (the tpu and gpu extras include gcs)"
        )


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def run_path(path) -> epath.Path:
    """The path as an epath.Path (local paths made absolute), after checking its scheme is usable."""
    check_supported(path)
    s = os.fspath(path)
    return epath.Path(s if is_remote(s) else os.path.abspath(s))
