"""Appending lines (metrics.jsonl) on object storage, which cannot append: segment objects, each rewritten whole."""

from __future__ import annotations

from etils import epath

from resformer_jax.storage.paths import is_remote

SEGMENT_LINES = 1000


class LineLog:
    """Appends lines to `path` and keeps them on a kill.

    Local: an appended file, flushed at each write. Object storage cannot append, so lines go to
    segment objects `path.parts/SSSSSS.jsonl`: each is rewritten whole at every write (an upload
    replaces an object atomically) and a new one starts after SEGMENT_LINES lines or when a new
    process opens the log, so no earlier segment is ever rewritten. `read_lines` reads both layouts.
    """

    def __init__(self, path):
        self.path = epath.Path(path)
        self.remote = is_remote(self.path)
        if not self.remote:
            self.f = open(self.path, "a")  # noqa: SIM115 - held open for the run, closed by close()
            return
        self.parts = _parts_dir(self.path)
        self.parts.mkdir(parents=True, exist_ok=True)
        self.segment = _next_segment(self.parts)
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        line = line.rstrip("\n") + "\n"
        if not self.remote:
            self.f.write(line)
            self.f.flush()
            return
        self.lines.append(line)
        (self.parts / f"{self.segment:06d}.jsonl").write_text("".join(self.lines))
        if len(self.lines) >= SEGMENT_LINES:
            self.segment, self.lines = self.segment + 1, []

    def close(self) -> None:
        if not self.remote:
            self.f.close()


def _parts_dir(path: epath.Path) -> epath.Path:
    return path.with_name(path.name + ".parts")


def _next_segment(parts: epath.Path) -> int:
    nums = [int(p.stem) for p in parts.glob("*.jsonl") if p.stem.isdigit()]
    return max(nums) + 1 if nums else 0


def has_lines(path) -> bool:
    p = epath.Path(path)
    return p.is_file() or (_parts_dir(p).is_dir() and any(_parts_dir(p).glob("*.jsonl")))


def read_lines(path) -> list[str]:
    """Every line a LineLog wrote to `path`, in order (the plain file, then its segments)."""
    p = epath.Path(path)
    out = []
    if p.is_file():
        out += p.read_text().splitlines()
    parts = _parts_dir(p)
    if parts.is_dir():
        for seg in sorted(parts.glob("*.jsonl"), key=lambda q: q.name):
            out += seg.read_text().splitlines()
    return [ln for ln in out if ln.strip()]


# --- Orbax on s3:// ----------------------------------------------------------------------------------
