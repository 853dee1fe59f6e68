"""Zero-shot scoring speed and memory (eval/loglik.py) at a config's shape, with random parameters: how long the
full validation sets would take here, from the sample tasks' items cycled to `items`."""

from __future__ import annotations

import resource
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
from tokenizers import Tokenizer

from resformer_jax.config import RunConfig
from resformer_jax.eval.loglik import ContinuationScorer
from resformer_jax.eval.zero_shot import check_tasks, make_loglik_fn, read_task, score_items, to_items
from resformer_jax.model import Transformer
from resformer_jax.resolve import for_backend

# Items in each task's full validation split (test split for ARC and OpenBookQA), as lm-evaluation-harness scores it.
FULL_SPLIT_ITEMS = {
    "hellaswag": 10042,
    "piqa": 1838,
    "winogrande": 1267,
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "openbookqa": 500,
}


def bench_zero_shot(cfg, task_data: str, tasks: list[str], items: int, tokenizer_json: str, batch: int) -> list[dict]:
    check_tasks(tasks, task_data)
    tok = Tokenizer.from_file(tokenizer_json)
    m = for_backend(RunConfig.of(cfg).model)  # random parameters at the config's shapes, auto unprobed
    params = nn.unbox(jax.jit(Transformer(m).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    scorer = ContinuationScorer(m, params, m.max_seq_len, batch)
    fn = make_loglik_fn(scorer, lambda s: tok.encode(s, add_special_tokens=False).ids)
    out = []
    for task in tasks:
        docs = read_task(task_data, task)
        its = to_items(task, [docs[i % len(docs)] for i in range(items)])
        t0 = time.perf_counter()
        score_items(its, fn)  # the first pass compiles each length bucket
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        score_items(its, fn)
        steady = time.perf_counter() - t0
        rate = len(its) / steady
        full = FULL_SPLIT_ITEMS.get(task)
        out.append(
            {
                "task": task,
                "items": len(its),
                "choices": sum(len(i["continuations"]) for i in its),
                "d_model": m.d_model,
                "num_layers": m.num_layers,
                "dtype": m.dtype,
                "max_seq_len": m.max_seq_len,
                "first_pass_s": round(first, 2),
                "items_per_s": round(rate, 2),
                "full_split_items": full,
                "full_split_projected_s": round(full / rate + (first - steady), 1) if full else None,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    return out
