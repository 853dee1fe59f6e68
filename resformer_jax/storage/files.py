"""Writing files that are never seen half-written, locally and on object storage (objects appear whole when their
upload ends): atomic text, JSON, figures, whole folders staged beside their target."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

from etils import epath

from resformer_jax.storage.paths import check_supported, is_remote


def write_text_atomic(path, text: str) -> None:
    """Writes a file so a reader never sees half of it: a local rename, or an object upload (objects
    appear whole when the upload ends)."""
    p = epath.Path(path)
    if is_remote(p):
        p.write_text(text)
        return
    tmp = p.with_name(p.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, p)


def write_json(path, obj, indent: int | None = 2) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


def move_tree(src, dst) -> None:
    """Moves a directory (replacing `dst`); on object storage a copy of every object, then a delete."""
    src, dst = epath.Path(src), epath.Path(dst)
    if dst.exists():
        dst.rmtree()
    if not is_remote(src):
        shutil.move(os.fspath(src), os.fspath(dst))
        return
    for f in files_under(src):
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        f.copy(out)
    src.rmtree()


def files_under(root) -> list[epath.Path]:
    """Every file below `root`, sorted (epath's rglob is refused on gs://, so a walk of iterdir)."""
    out: list[epath.Path] = []
    todo = [epath.Path(root)]
    while todo:
        for p in todo.pop().iterdir():
            (todo if p.is_dir() else out).append(p)
    return sorted(out, key=str)


def copy_file(src, dst) -> None:
    epath.Path(src).copy(epath.Path(dst), overwrite=True)


def save_figure(fig, path, dpi: int = 100) -> None:
    """A matplotlib figure as PNG at `path` (local or object storage)."""
    with epath.Path(path).open("wb") as f:
        fig.savefig(f, format="png", dpi=dpi)


@contextlib.contextmanager
def staged_dir(out):
    """A local folder to write into for libraries that write local files only (safetensors); when `out` is
    on object storage its files are uploaded after the block succeeds (nothing is uploaded on an error)."""
    if not is_remote(out):
        os.makedirs(out, exist_ok=True)
        yield os.fspath(out)
        return
    check_supported(out)

    with tempfile.TemporaryDirectory() as d:
        yield d
        dst = epath.Path(out)
        # config.json last: a folder whose upload stopped part-way never looks like a finished model
        for f in sorted(files_under(d), key=lambda f: f.name == "config.json"):
            target = dst / f.relative_to(d)
            target.parent.mkdir(parents=True, exist_ok=True)
            f.copy(target, overwrite=True)


# --- TensorBoard event files on object storage ----------------------------------------------------------
