"""Benchmarks on whatever device is present. Each prints one JSON object per measurement.

  resformer bench train --config=configs/transformer_82m.py --steps=5 [--profile_dir=DIR] \\
      --config.train.global_batch=8 --config.data.seq_len=512 --config.model.dtype=float32 \\
      [--compare=none,resformer,svformer] [--compare_dtypes=float32,bfloat16] [--compare_telemetry] [--compile_only]
  resformer bench attention --shapes=4,2048,16,16,64 [--impls=xla,pallas,reference] [--dtype=bfloat16]
  resformer bench decode --config=configs/svformer_82m.py --context=2048 --new_tokens=64 \\
      [--compare=none,svformer] [--batch=1]
  resformer bench accelerator [--out=report.json]   # first thing to run on new hardware
  resformer bench serve --url=http://127.0.0.1:8000 --requests=64 --rate=4 --context=512 --new_tokens=64 \\
      [--data=PREPARED_DIR] [--concurrency=16]   # a served run under load: TTFT, ITL, tokens/s
  resformer bench serve --url=http://127.0.0.1:8000 --check   # which parts of the OpenAI API any server answers
  resformer bench data --config=configs/resformer_82m.py --config.data.path=DIR [--steps=200] \\
      [--step_tokens_per_s=X]    # the training input pipeline's tokens/s against what the step consumes
  resformer bench zero_shot --config=configs/resformer_82m.py --task_data=DIR --tokenizer=FILE \\
      [--tasks=hellaswag] [--items=256]   # items/s and peak memory; the full validation split's projected time

train: compile seconds, median step seconds, tokens/s (total and per device), MFU in
two conventions (6N with N the non-embedding parameters, and the model's own FLOP
count with causal attention) against the device peak (on CPU: matmul throughput measured
at the compute dtype, the best sample; `mfu_model_vs_median_peak` against the median
sample; `mfu_model_vs_paired_peak` each step against the sample taken just before it, the
median over steps), memory: XLA's per-device estimate of the compiled step (arguments + outputs +
temporaries) and the device's peak in use (GPU/TPU) or process RSS (CPU), and
`step_breakdown`: the step's time by group from a real XLA profile (benchmarks/step_profile.py), with the
matmuls' share of it, from which `matmul_flops_per_s_in_step` (their rate inside the step) and
`mfu_model_matmuls_only` (the MFU of a step that ran only its matmuls).
Each benchmark is a module of resformer_jax/benchmarks/; BENCHMARKS below maps the subcommands to them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
from typing import Any

from absl import app, flags
from ml_collections import config_flags

from resformer_jax.commands import common as cli
from resformer_jax.config import RunConfig

config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=False)
flags.DEFINE_integer("steps", 5, "Timed steps (after 2 warm-up steps).")
flags.DEFINE_string("compare", None, "Comma-separated value_residual modes to run at the same shapes.")
flags.DEFINE_string(
    "compare_dtypes",
    None,
    "train: comma-separated compute dtypes (e.g. float32,bfloat16) to run "
    "at the same shapes, interleaved like --compare (with --compare: every variant in every dtype).",
)
flags.DEFINE_bool(
    "compare_telemetry",
    False,
    "train: each variant also as a logged step of a run with train.telemetry (its program computes the per-layer "
    "norms; unlogged steps run the plain one), interleaved like --compare: the cost of a logged step as a ratio.",
)
flags.DEFINE_integer(
    "documents",
    0,
    "train: > 0: the batches are packed documents of this mean length in tokens (each ended by the last token id), "
    "and each variant also runs with data.document_mask, interleaved like --compare: the document mask's cost.",
)
flags.DEFINE_bool("compile_only", False, "train: only lower and compile; report compile seconds.")
flags.DEFINE_integer(
    "profile_steps",
    1,
    "train: steps run under jax.profiler (one per round, in the last rounds), for the "
    "step_breakdown (matmuls, attention, LM head + CE, norms/elementwise, optimizer, host); 0: none.",
)
flags.DEFINE_string(
    "profile_dir",
    None,
    "train: keep the profiler traces here (DIR/<variant>; open with TensorBoard's "
    "profile plugin: tensorboard --logdir DIR). Default: a temporary folder, deleted.",
)
flags.DEFINE_bool(
    "interleave",
    True,
    "train --compare: variants take turns step by step (False: one after another, one state in memory at a time).",
)
flags.DEFINE_multi_string("shapes", ["2,1024,8,8,64"], "attention: B,T,H,K,D (repeatable).")
flags.DEFINE_string("impls", "xla,pallas,reference", "attention: impls to time.")
flags.DEFINE_string("dtype", "float32", "attention: input dtype.")
flags.DEFINE_integer("context", 2048, "decode: prompt length.")
flags.DEFINE_integer("new_tokens", 32, "decode: tokens to generate.")
flags.DEFINE_integer("batch", 1, "decode: batch size.")
flags.DEFINE_string(
    "matrix",
    None,
    "decode: BATCHES:CONTEXTS, e.g. 1,16:512,2048 -- every combination, the --compare "
    "variants interleaved, with bytes read per token and the fraction of measured memory bandwidth.",
)
flags.DEFINE_bool(
    "prefill",
    True,
    "decode --matrix: run the prompts (False: take their pages without computing them; the decode steps read "
    "the same bytes, and a CPU times batch 32 at 2,048 tokens in seconds, not the prefill's minutes).",
)
flags.DEFINE_float("temperature", 0.0, "decode: every request's sampling temperature (0: greedy).")
flags.DEFINE_integer("top_k", 0, "decode: sample among the k most likely tokens (0: off).")
flags.DEFINE_float("top_p", 1.0, "decode: sample from the nucleus of this probability mass (1: off).")
flags.DEFINE_float("min_p", 0.0, "decode: sample tokens at least this times as likely as the most likely (0: off).")
flags.DEFINE_float("frequency_penalty", 0.0, "decode: every request's frequency penalty (0: off; presence as 0).")
flags.DEFINE_float("repetition_penalty", 1.0, "decode: every request's repetition penalty (1: off).")
flags.DEFINE_integer("rounds", 3, "decode --matrix: interleaved rounds per combination (median reported).")
flags.DEFINE_integer("decode_steps", 8, "decode --matrix/--stream: decode steps a program runs between readbacks.")
flags.DEFINE_integer(
    "stream",
    0,
    "decode: N requests of mixed prompt lengths (16..--context) through each variant's engine at one cache budget "
    "(--cache_gib): tokens/s, time to first token, inter-token latency, the most sequences held at once.",
)
flags.DEFINE_float("rate", 0.0, "decode --stream, serve: Poisson arrivals a second (0: all at once).")
flags.DEFINE_string("url", None, "serve: the server to load (resformer serve), e.g. http://127.0.0.1:8000.")
flags.DEFINE_bool(
    "check", False, "serve: instead of a load, check which parts of the OpenAI API the server answers as specified."
)
flags.DEFINE_integer("requests", 64, "serve: requests to send.")
flags.DEFINE_integer("concurrency", 0, "serve: requests in flight at most (0: no limit).")
flags.DEFINE_multi_string("stop", [], "serve: a stop string every request sends (repeatable): their checks' cost.")
flags.DEFINE_string("data", None, "serve: a prepared corpus whose validation text the prompts are cut from.")
flags.DEFINE_integer(
    "prompt_min", 16, "serve, decode --stream: the shortest prompt (tokens); the longest is --context."
)
flags.DEFINE_integer(
    "shared_prefixes",
    0,
    "serve, decode --stream: N > 0: a shared-prefix workload (as vLLM's and SGLang's prefix benchmarks): N "
    "distinct prefixes of --prefix_len tokens, request i the prefix i %% N then a distinct suffix (serve: of "
    "--prompt_min..--context tokens).",
)
flags.DEFINE_integer(
    "prefix_len", 512, "serve, decode --stream: the shared prefixes' length (tokens), with --shared_prefixes."
)
flags.DEFINE_bool("prefix_cache", True, "decode --stream: the engine's prefix cache (False: every prompt computed).")
flags.DEFINE_float("cache_gib", 0.25, "decode --stream: the paged KV cache's budget, the same for every variant.")
flags.DEFINE_string("out", None, "accelerator: also write the JSON report to this file.")
flags.DEFINE_string(
    "task_data", None, "zero_shot: folder with the tasks' files (the samples: ../shared/data/eval_samples)."
)
flags.DEFINE_string("tokenizer", None, "zero_shot: tokenizer.json to encode the tasks with.")
flags.DEFINE_string("tasks", "hellaswag", "zero_shot: comma-separated tasks.")
flags.DEFINE_integer("items", 256, "zero_shot: items per task (the file's items cycled).")
flags.DEFINE_integer("score_batch", 0, "zero_shot: choices per forward pass (0: sized to memory, as evaluate).")
flags.DEFINE_float(
    "step_tokens_per_s",
    0.0,
    "data: the train step's tokens/s to compare with (0: time the config's step here, 3 steps).",
)
FLAGS = flags.FLAGS

# The flags each benchmark reads, besides --config and --compare for those that take a config: the one table of
# which flag is whose. A flag given to a benchmark that does not read it is refused, naming those that do.
BENCHMARK_FLAGS = {
    "train": (
        "steps",
        "compare_dtypes",
        "compare_telemetry",
        "documents",
        "compile_only",
        "profile_steps",
        "profile_dir",
        "interleave",
    ),
    "attention": ("shapes", "impls", "dtype"),
    "decode": (
        "context",
        "new_tokens",
        "batch",
        "matrix",
        "prefill",
        "rounds",
        "decode_steps",
        "stream",
        "rate",
        "prompt_min",
        "shared_prefixes",
        "prefix_len",
        "prefix_cache",
        "cache_gib",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "frequency_penalty",
        "repetition_penalty",
    ),
    "data": ("steps", "step_tokens_per_s"),
    "accelerator": ("out",),
    "zero_shot": ("task_data", "tokenizer", "tasks", "items", "score_batch"),
    "serve": (
        "url",
        "check",
        "requests",
        "concurrency",
        "stop",
        "data",
        "context",
        "new_tokens",
        "rate",
        "prompt_min",
        "shared_prefixes",
        "prefix_len",
    ),
}


def check_flags_belong(what: str, needs_config: bool) -> None:
    """A flag on the command line that benchmark `what` does not read: one usage error naming who reads it."""
    own = {n for names in BENCHMARK_FLAGS.values() for n in names} | {"config", "compare"}
    allowed = set(BENCHMARK_FLAGS[what]) | ({"config", "compare"} if needs_config else set())
    for name in sorted(n for n in own if FLAGS[n].present and n not in allowed):
        readers = [b for b, names in BENCHMARK_FLAGS.items() if name in names] or [
            b for b, (_, takes_config, _) in BENCHMARKS.items() if takes_config
        ]
        raise app.UsageError(
            f"--{name} is not a flag of bench {what} (it is read by bench {', '.join(readers)}); drop it, or run "
            f"that benchmark"
        )


def run_train(modes: list[str]) -> list[dict]:
    from resformer_jax.benchmarks.train import bench_train
    from resformer_jax.resolve import resolve_attention, resolve_dtype

    if not FLAGS.compare_dtypes:
        # model.dtype=auto: measured once, so every compared variant runs in the same dtype
        FLAGS.config.model.dtype = resolve_dtype(FLAGS.config, log=lambda m: print(m, file=sys.stderr))[0]
    cfgs = _variants(modes, FLAGS.compare_dtypes.split(",") if FLAGS.compare_dtypes else [FLAGS.config.model.dtype])
    # `auto` is probed once, at the first variant's shapes, and used by every variant.
    attention = resolve_attention(cfgs[0], batch=1, log=lambda m: print(m, file=sys.stderr))
    timing = (FLAGS.steps, FLAGS.compile_only, FLAGS.interleave, attention, FLAGS.profile_dir, FLAGS.profile_steps)
    return bench_train(cfgs, *timing, document_len=FLAGS.documents)


def run_decode(modes: list[str]) -> list[dict]:
    from resformer_jax.benchmarks.decode import bench_decode, bench_decode_matrix
    from resformer_jax.engine import SamplingParams

    sampling = SamplingParams(
        temperature=FLAGS.temperature,
        top_k=FLAGS.top_k,
        top_p=FLAGS.top_p,
        min_p=FLAGS.min_p,
        frequency_penalty=FLAGS.frequency_penalty,
        repetition_penalty=FLAGS.repetition_penalty,
    )
    sampling.check()  # a knob out of range: one line naming it
    models = [RunConfig.of(c).model for c in _variants(modes, [FLAGS.config.model.dtype])]
    if FLAGS.matrix:
        b_text, _, c_text = FLAGS.matrix.partition(":")
        try:
            batches, contexts = [int(x) for x in b_text.split(",")], [int(x) for x in c_text.split(",")]
        except ValueError:
            raise cli.ConfigFlagError(
                f"--matrix={FLAGS.matrix!r}: expected BATCHES:CONTEXTS, e.g. 1,16:512,2048"
            ) from None
        how = dict(prefill=FLAGS.prefill, decode_steps=FLAGS.decode_steps, sampling=sampling)
        for r in bench_decode_matrix(models, batches, contexts, FLAGS.new_tokens, FLAGS.rounds, **how):
            print(json.dumps(r), flush=True)  # each row as it is measured
        return []
    if FLAGS.stream:
        from resformer_jax.benchmarks.decode import bench_decode_stream

        load = (FLAGS.cache_gib, FLAGS.stream, FLAGS.rate, FLAGS.context, FLAGS.new_tokens)
        stream: dict[str, Any] = dict(decode_steps=FLAGS.decode_steps, sampling=sampling, prompt_min=FLAGS.prompt_min)
        stream.update(
            shared_prefixes=FLAGS.shared_prefixes, prefix_len=FLAGS.prefix_len, prefix_cache=FLAGS.prefix_cache
        )
        for r in bench_decode_stream(models, *load, **stream):
            print(json.dumps(r))
        return []
    return [bench_decode(m, FLAGS.context, FLAGS.new_tokens, FLAGS.batch, sampling) for m in models]


def run_data(modes: list[str]) -> list[dict]:
    from resformer_jax.benchmarks.data import bench_data

    return [bench_data(FLAGS.config, FLAGS.steps, FLAGS.step_tokens_per_s)]


def run_attention(modes: list[str]) -> list[dict]:
    import jax.numpy as jnp

    from resformer_jax.benchmarks.attention import bench_attention
    from resformer_jax.kernels.names import IMPLS

    for spec in FLAGS.shapes:
        parts = spec.split(",")
        if len(parts) != 5 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise cli.ConfigFlagError(
                f"--shapes={spec!r}: expected five positive integers B,T,H,K,D (e.g. 4,2048,16,4,64)"
            )
        if int(parts[2]) % int(parts[3]):
            raise cli.ConfigFlagError(
                f"--shapes={spec!r}: K={parts[3]} kv heads do not divide H={parts[2]} query heads"
            )
    unknown = [i for i in FLAGS.impls.split(",") if i not in IMPLS]
    if unknown:
        raise cli.ConfigFlagError(
            f"--impls: unknown {unknown}; choose from {', '.join(i for i in IMPLS if i != 'auto')}"
        )
    return bench_attention(FLAGS.shapes, FLAGS.impls.split(","), jnp.dtype(FLAGS.dtype).type)


def run_zero_shot(modes: list[str]) -> list[dict]:
    from resformer_jax.benchmarks.zero_shot import bench_zero_shot

    if not FLAGS.task_data or not FLAGS.tokenizer:
        raise cli.ConfigFlagError("bench zero_shot needs --task_data=DIR and --tokenizer=FILE (tokenizer.json)")

    if not os.path.isfile(FLAGS.tokenizer):
        raise cli.ConfigFlagError(
            f"--tokenizer={FLAGS.tokenizer}: no such file; give a tokenizer.json (e.g. "
            "../shared/data/tokenizers/gpt-neox-20b.json)"
        )
    if FLAGS.items < 1:
        raise cli.ConfigFlagError(f"--items={FLAGS.items}: must be at least 1")
    tasks = [t for t in FLAGS.tasks.split(",") if t]
    return bench_zero_shot(FLAGS.config, FLAGS.task_data, tasks, FLAGS.items, FLAGS.tokenizer, FLAGS.score_batch)


def run_accelerator(modes: list[str]) -> list[dict]:
    from resformer_jax.benchmarks import accelerator

    accelerator.main(FLAGS.out)
    return []


def run_serve(modes: list[str]) -> list[dict]:
    missing = [m for m in ("httpx", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise cli.ConfigFlagError(f"bench serve needs {', '.join(missing)}; install it: pip install -e '.[serve]'")
    import httpx

    from resformer_jax.benchmarks.serve import bench_serve, corpus_prompts

    if not FLAGS.url:
        raise cli.ConfigFlagError("bench serve needs --url=http://HOST:PORT of a running `resformer serve`")
    if FLAGS.check:
        return check_serve(FLAGS.url)
    try:
        model = httpx.get(f"{FLAGS.url.rstrip('/')}/v1/models", timeout=10).json()["data"][0]
        name, vocab = model["id"], int(model["vocab_size"])  # random prompts stay inside the served vocabulary
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise cli.ConfigFlagError(f"--url={FLAGS.url}: no resformer server answers there ({e}); start one") from None
    prompts = corpus_prompts(FLAGS.data, FLAGS.requests, FLAGS.prompt_min, FLAGS.context, vocab)
    if FLAGS.shared_prefixes > 0:
        prefixes = corpus_prompts(FLAGS.data, FLAGS.shared_prefixes, FLAGS.prefix_len, FLAGS.prefix_len, vocab, seed=1)
        prompts = [prefixes[i % len(prefixes)] + p for i, p in enumerate(prompts)]
    out = bench_serve(FLAGS.url, prompts, FLAGS.new_tokens, FLAGS.rate, FLAGS.concurrency, stop=tuple(FLAGS.stop))
    print(json.dumps({"model": name, **out}))
    return []


def check_serve(url: str) -> list[dict]:
    """One line a check (ok or FAIL, what it saw), then the counts as JSON; exit 1 if any failed."""
    import httpx

    from resformer_jax.benchmarks.conformance import check_server

    try:
        checks = check_server(url)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise cli.ConfigFlagError(f"--url={url}: no OpenAI-compatible server answers /v1/models there ({e})") from None
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
    failed = [c.name for c in checks if not c.ok]
    print(json.dumps({"url": url, "checks": len(checks), "passed": len(checks) - len(failed), "failed": failed}))
    if failed:
        sys.exit(1)
    return []


# subcommand -> (runner, needs --config, the result key compared across variants)
BENCHMARKS = {
    "train": (run_train, True, "median_step_s"),
    "attention": (run_attention, False, None),
    "decode": (run_decode, True, "decode_tokens_per_s"),
    "data": (run_data, True, None),
    "accelerator": (run_accelerator, False, None),
    "zero_shot": (run_zero_shot, True, None),
    "serve": (run_serve, False, None),
}


def _variants(modes: list[str], dtypes: list[str]) -> list:
    cfgs = []
    for mode in modes:
        for dtype in dtypes:
            for telemetry in (False, True) if FLAGS.compare_telemetry else (None,):
                for documents in (False, True) if FLAGS.documents > 0 else (None,):
                    cfg = FLAGS.config.copy_and_resolve_references()
                    cfg.model.value_residual, cfg.model.dtype = mode, dtype
                    if telemetry is not None:
                        cfg.train.telemetry = telemetry
                    if documents is not None:  # the end-of-text token: the last id (benchmarks/timing.random_tokens)
                        cfg.data.document_mask, cfg.data.eot_id = documents, cfg.model.vocab_size - 1
                    cfgs.append(cfg)
    return cfgs


def _label(r: dict) -> str:
    """What a result's ratio is keyed by: the variant, its dtype where several, + telemetry where compared."""
    out = r["variant"] + (f"/{r.get('dtype')}" if FLAGS.compare_dtypes else "")
    out += "+documents" if FLAGS.documents > 0 and r.get("document_mask") else ""
    return out + ("+telemetry" if FLAGS.compare_telemetry and r.get("telemetry") else "")


def print_ratios(what: str, results: list[dict], key: str):
    """The variants' ratios to the first one (and, for interleaved train steps, the median per-round ratio)."""
    # what the ratios are keyed by: the variant, and its dtype where several are compared
    label = _label
    base = results[0]
    if key not in base:
        return
    ratios = {label(r): round(r[key] / base[key], 4) for r in results}
    extra = (
        {"kv_cache_ratio": {label(r): round(r["kv_cache_bytes"] / base["kv_cache_bytes"], 4) for r in results}}
        if what == "decode"
        else {}
    )
    if what == "train" and FLAGS.interleave and not FLAGS.compile_only:
        # Steps of one round ran back to back: the median of per-round ratios cancels host drift.
        extra["paired_median_step_ratio"] = {
            label(r): round(statistics.median(a / b for a, b in zip(r["step_s"], base["step_s"])), 4) for r in results
        }
    print(json.dumps({"ratio_to_" + label(base): {key: ratios}, **extra}))


def main(argv):
    cli.start()
    if len(argv) < 2 or argv[1] not in BENCHMARKS:
        raise app.UsageError(f"name a benchmark: resformer bench {{{','.join(BENCHMARKS)}}} [flags]")
    what = argv[1]
    runner, needs_config, key = BENCHMARKS[what]
    check_flags_belong(what, needs_config)
    if needs_config and FLAGS.config is None:
        raise app.UsageError("--config is required")
    modes = (FLAGS.compare.split(",") if FLAGS.compare else [FLAGS.config.model.value_residual]) if needs_config else []
    with cli.exit_on_user_error():
        results = runner(modes)
    for r in results:
        print(json.dumps(r))
    if len(results) > 1 and key:
        print_ratios(what, results, key)


def cli_main():
    cli.check_config_flags(sys.argv)
    cli.run_app(main, sys.modules[__name__])
