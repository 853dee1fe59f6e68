"""Trained tiny runs shared by a whole test session: one run per config, keyed by the config's hash (never by a
test's order), trained by the first test that asks and read by every later one, in either pytest-xdist worker
(a file lock makes the other wait). A test that writes into a run asks for its own copy."""

from __future__ import annotations

import fcntl
import hashlib
import json
import pathlib
import shutil


class SharedRuns:
    def __init__(self, root: pathlib.Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def get(self, cfg, copy_to: pathlib.Path | None = None) -> pathlib.Path:
        """The finished run of ConfigDict `cfg` (trained here on first use); with copy_to, a copy of it there that
        the test may change."""
        from resformer_jax.commands.training import run

        key = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]
        folder, done = self.root / key / "run", self.root / key / "done"
        with open(self.root / f"{key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits while this one trains
            if not done.exists():
                if folder.exists():  # a run an earlier (killed) session left half-trained
                    shutil.rmtree(folder)
                folder.parent.mkdir(parents=True, exist_ok=True)
                assert run(cfg, str(folder)) == 0, f"the shared run {key} did not finish"
                done.write_text(json.dumps(cfg.to_dict(), sort_keys=True, default=str))
        if copy_to is None:
            return folder
        shutil.copytree(folder, copy_to)
        return copy_to
