"""The demo corpus: the Python standard library's own source, built offline on any machine.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sysconfig

DOMAIN = "PythonStdlib"
VOCAB = 1024
MAX_TRAIN_BYTES = 3_000_000


def cache_root() -> str:
    return os.environ.get("RESFORMER_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "resformer_jax"))


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "test", "tests", "idlelib", "__pycache__"))
        out += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    return out


def demo_corpus(seq_len: int) -> str:
    """Builds (once, under a file lock) and returns the prepared demo corpus folder."""
    out = os.path.join(cache_root(), f"demo_stdlib_v1_seq{seq_len}")
    if os.path.isfile(os.path.join(out, "metadata.json")):
        return out
    os.makedirs(cache_root(), exist_ok=True)
    with open(os.path.join(cache_root(), ".demo.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several processes may start at once
        if os.path.isfile(os.path.join(out, "metadata.json")):
            return out
        raw = out + ".raw"
        for split in ("train", "validation"):
            os.makedirs(os.path.join(raw, split), exist_ok=True)
        sizes = {"train": 0, "validation": 0}
        with (
            open(os.path.join(raw, "train", "stdlib.jsonl"), "w") as tr,
            open(os.path.join(raw, "validation", "stdlib.jsonl"), "w") as va,
        ):
            for path in _stdlib_files():
                try:
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                except (UnicodeDecodeError, OSError):
                    continue
                h = int(hashlib.md5(os.path.basename(path).encode()).hexdigest(), 16) % 100
                split = "validation" if h < 5 else "train"
                if sizes[split] > (MAX_TRAIN_BYTES if split == "train" else MAX_TRAIN_BYTES // 10):
                    continue
                sizes[split] += len(text)
                rec = {"text": text, "meta": {"redpajama_set_name": DOMAIN}}
                (va if split == "validation" else tr).write(json.dumps(rec) + "\n")
        from resformer_jax.data_prep.prepare import prepare

        print(
            f"[demo] building the demo corpus from the Python standard library ({sizes['train']:,} bytes train, "
            f"{sizes['validation']:,} validation) into {out}",
            flush=True,
        )
        prepare([raw], f"train:{VOCAB}", out, seq_len=seq_len, command="resformer_jax demo corpus", quiet=True)
    return out
