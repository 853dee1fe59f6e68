"""A load generator for a served run (`resformer serve`), as vLLM's serving benchmark measures one: requests with
Poisson arrivals at a rate (or a fixed number in flight), prompts of mixed lengths cut from a prepared corpus's
validation split (or random ids), each streamed; request throughput, tokens/s, time to first token and inter-token
latency at p50/p90/p99."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np


def corpus_prompts(path: str | None, n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of lo..hi token ids: windows of a prepared corpus's records (data_prep's layout), or random ids."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, n)
    if path is None:
        return [rng.integers(0, vocab, k).tolist() for k in lengths]
    from resformer_jax.data.records import DomainSource, load_metadata

    meta = load_metadata(path)
    split = "validation" if meta["splits"].get("validation") else "train"
    sources = [DomainSource(path, meta, split, d) for d in sorted(meta["splits"][split])]
    out = []
    for k in lengths:
        src = sources[int(rng.integers(0, len(sources)))]
        row = src[int(rng.integers(0, len(src)))]
        start = int(rng.integers(0, max(1, len(row) - k)))
        out.append([int(t) for t in row[start : start + k]])
    return out


async def _one(client, url: str, prompt: list[int], max_tokens: int, seed: int, stop) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": True}
    body.update({"stop": list(stop)} if stop else {})
    t0 = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return {"error": (await r.aread()).decode()[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                if c.get("token_ids"):
                    times.append(time.perf_counter())
                    tokens += len(c["token_ids"])
    # time per output token (vLLM's TPOT): first token to last, a token, however the chunks grouped them
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None
    return {"ttft": times[0] - t0 if times else None, "itl": list(np.diff(times)), "tpot": tpot, "tokens": tokens}


async def _load(url: str, prompts, max_tokens: int, rate: float, concurrency: int, seed: int, stop) -> list[dict]:
    import httpx

    rng = np.random.default_rng(seed)
    gate = asyncio.Semaphore(concurrency if concurrency > 0 else len(prompts))
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:

        async def run(i, p):
            async with gate:
                return await _one(client, url, p, max_tokens, seed + i, stop)

        tasks = []
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(run(i, p)))
            if rate > 0:
                await asyncio.sleep(float(rng.exponential(1 / rate)))
        return await asyncio.gather(*tasks)


def _server_gauges(url: str) -> dict:
    """What the server's /metrics says of its cache after the load: the most sequences it held at once, its pages."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    want = {
        "resformer:max_sequences_cached": "server_max_sequences_cached",
        "resformer:kv_cache_pages_total": "server_cache_pages",
        "vllm:prefix_cache_queries_total": "server_prefix_queries",
        "vllm:prefix_cache_hits_total": "server_prefix_hits",
        "vllm:num_preemptions_total": "server_preemptions",
    }
    try:
        text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
    return {want[s.name]: int(s.value) for s in samples if s.name in want}


def bench_serve(
    url: str, prompts, max_tokens: int, rate: float = 0.0, concurrency: int = 0, seed: int = 0, stop=()
) -> dict:
    """Drives the server at `url` with `prompts` (Poisson arrivals at `rate` a second, 0: all at once; at most
    `concurrency` in flight, 0: no limit; each request with the `stop` strings) and reports what a client saw."""
    before = _server_gauges(url)
    t0 = time.perf_counter()
    results = asyncio.run(_load(url.rstrip("/"), prompts, max_tokens, rate, concurrency, seed, stop))
    wall = time.perf_counter() - t0
    after = _server_gauges(url)
    # this load's share of the server's counters (they count since it started)
    counted = {
        k: after[k] - before.get(k, 0)
        for k in ("server_prefix_queries", "server_prefix_hits", "server_preemptions")
        if k in after
    }
    queries = counted.get("server_prefix_queries", 0)
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [d for r in ok for d in r["itl"]]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 4) if xs else None
    return {
        **{k: v for k, v in after.items() if k not in counted},
        **counted,
        "prefix_hit_rate": round(counted.get("server_prefix_hits", 0) / queries, 4) if queries else None,
        "url": url,
        "requests": len(prompts),
        "failed": len(results) - len(ok),
        **({"first_error": next(r["error"] for r in results if "error" in r)} if len(ok) < len(results) else {}),
        "rate": rate,
        "concurrency": concurrency,
        "stop": list(stop),
        "seconds": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3),
        "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2),
        **{f"ttft_p{q}_s": pct(ttft, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_s": pct(itl, q) for q in (50, 90, 99)},
        **{f"tpot_p{q}_s": pct(tpot, q) for q in (50, 90, 99)},
    }
