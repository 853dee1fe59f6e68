"""A smaller copy of ../shared/data's SlimPajama sample, in its layout (train/ and validation/ chunks of .jsonl.zst),
for tests whose point is the path through prepare and a command, not the corpus's size: every domain kept."""

from __future__ import annotations

import json
import pathlib

import zstandard


def trimmed_slimpajama(
    shared_data: pathlib.Path, out: pathlib.Path, docs_per_domain: int, chars_per_doc: int
) -> pathlib.Path:
    """Writes the first `docs_per_domain` documents of each domain of each split's files, each cut to its first
    `chars_per_doc` characters, under `out`; returns it."""
    source = shared_data / "slimpajama_sample"
    for path in sorted(source.rglob("*.jsonl.zst")):
        with open(path, "rb") as f:
            lines = zstandard.ZstdDecompressor().stream_reader(f).read().decode().splitlines()
        kept, per_domain = [], {}
        for line in lines:
            if not line.strip():
                continue
            doc = json.loads(line)
            domain = doc["meta"]["redpajama_set_name"]
            if per_domain.get(domain, 0) < docs_per_domain:
                per_domain[domain] = per_domain.get(domain, 0) + 1
                kept.append(json.dumps(dict(doc, text=doc["text"][:chars_per_doc])))
        target = out / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(kept) + "\n").encode()))
    return out
