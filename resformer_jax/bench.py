"""Benchmarks on whatever device is present. Each prints one JSON object per measurement.

  python -m resformer_jax.bench train --config=configs/transformer_82m.py --steps=5 [--profile_dir=DIR] \
      --config.train.global_batch=8 --config.data.seq_len=512 --config.model.dtype=float32 \
      [--compare=none,resformer,svformer] [--compare_dtypes=float32,bfloat16] [--compile_only]
  python -m resformer_jax.bench attention --shapes=4,2048,16,16,64 [--impls=xla,pallas,reference] [--dtype=bfloat16]
  python -m resformer_jax.bench decode --config=configs/svformer_82m.py --context=2048 --new_tokens=64 \
      [--compare=none,svformer] [--batch=1]
  python -m resformer_jax.bench accelerator [--out=report.json]   # first thing to run on new hardware
  python -m resformer_jax.bench data --config=configs/resformer_82m.py --config.data.path=DIR [--steps=200] \
      [--step_tokens_per_s=X]    # the training input pipeline's tokens/s against what the step consumes

train: compile seconds, median step seconds, tokens/s (total and per device), MFU in
two conventions (6N with N the non-embedding parameters, and the model's own FLOP
count with causal attention) against the device peak (on CPU: matmul throughput measured
at the compute dtype, the best sample; `mfu_model_vs_median_peak` against the median
sample; `mfu_model_vs_paired_peak` each step against the sample taken just before it, the
median over steps), memory: XLA's per-device estimate of the compiled step (arguments + outputs +
temporaries) and the device's peak in use (GPU/TPU) or process RSS (CPU), and
`step_breakdown`: the step's time by group from a real XLA profile (step_profile.py).
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time

from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=False)
flags.DEFINE_integer("steps", 5, "Timed steps (after 2 warm-up steps).")
flags.DEFINE_string("compare", None, "Comma-separated value_residual modes to run at the same shapes.")
flags.DEFINE_string("compare_dtypes", None, "train: comma-separated compute dtypes (e.g. float32,bfloat16) to run "
                    "at the same shapes, interleaved like --compare (with --compare: every variant in every dtype).")
flags.DEFINE_bool("compile_only", False, "train: only lower and compile; report compile seconds.")
flags.DEFINE_integer("profile_steps", 1, "train: steps run under jax.profiler (one per round, in the last rounds), for the "
                     "step_breakdown (matmuls, attention, LM head + CE, norms/elementwise, optimizer, host); 0: none.")
flags.DEFINE_string("profile_dir", None, "train: keep the profiler traces here (DIR/<variant>; open with TensorBoard's "
                    "profile plugin: tensorboard --logdir DIR). Default: a temporary folder, deleted.")
flags.DEFINE_bool("interleave", True, "train --compare: variants take turns step by step (False: one after "
                  "another, one state in memory at a time).")
flags.DEFINE_multi_string("shapes", ["2,1024,8,8,64"], "attention: B,T,H,K,D (repeatable).")
flags.DEFINE_string("impls", "xla,pallas,reference", "attention: impls to time.")
flags.DEFINE_string("dtype", "float32", "attention: input dtype.")
flags.DEFINE_integer("context", 2048, "decode: prompt length.")
flags.DEFINE_integer("new_tokens", 32, "decode: tokens to generate.")
flags.DEFINE_integer("batch", 1, "decode: batch size.")
flags.DEFINE_string("matrix", None, "decode: BATCHES:CONTEXTS, e.g. 1,16:512,2048 -- every combination, the --compare "
                    "variants interleaved, with bytes read per token and the fraction of measured memory bandwidth.")
flags.DEFINE_integer("rounds", 3, "decode --matrix: interleaved rounds per combination (median reported).")
flags.DEFINE_string("out", None, "accelerator: also write the JSON report to this file.")
flags.DEFINE_float("step_tokens_per_s", 0.0, "data: the train step's tokens/s to compare with (0: time the "
                   "config's step here, 3 steps).")
FLAGS = flags.FLAGS


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class TrainBench:
    """One variant's compiled train step (built by train/setup.py, as training builds it), its state
    and its timings."""

    def __init__(self, cfg, attention=None):
        import jax
        import numpy as np
        from resformer_jax.train.setup import build
        self.cfg = cfg
        self.setup = build(cfg, attention=attention, log=lambda m: print(m, file=sys.stderr))
        self.compiled, compile_s, mem = self.setup.compile()
        self.mem = mem
        self.shape = self.setup.global_batch_shape
        self.out = {"variant": cfg.model.value_residual, "scan_layers": cfg.model.scan_layers,
                    "remat": cfg.model.remat, "attention_impl": self.setup.model_cfg.attention_impl,
                    "num_layers": cfg.model.num_layers, "batch": cfg.train.global_batch,
                    "seq_len": cfg.data.seq_len, "dtype": cfg.model.dtype, "devices": jax.device_count(),
                    "device_kind": jax.devices()[0].device_kind, "compile_s": round(compile_s, 3),
                    "xla_memory_bytes_per_device": mem.total if mem is not None else None,
                    "xla_temp_bytes_per_device": mem.temporaries if mem is not None else None}
        self.times, self.state, self.profiles, self.hlo = [], None, [], None
        self.round_peaks = []  # CPU: the matmul peak sampled just before each timed step
        self._tokens = lambda: jax.device_put(  # noqa: E731
            np.random.default_rng(0).integers(0, cfg.model.vocab_size, self.shape, dtype=np.int32),
            self.setup.batch_sh)

    def warm_up(self, steps=2):
        import jax
        from resformer_jax.train.setup import memory_precheck
        memory_precheck(self.mem, self.cfg.mesh)  # a clear error before a step that cannot fit, as training does
        self.state = self.setup.init_state(seed=0)
        self.tokens = self._tokens()
        for _ in range(steps):
            self.state, m = self.compiled(self.state, self.tokens)
        jax.block_until_ready(m)

    def timed_step(self):
        import jax
        t = time.perf_counter()
        self.state, self.metrics = self.compiled(self.state, self.tokens)
        jax.block_until_ready(self.metrics)
        self.times.append(time.perf_counter() - t)

    def profiled_step(self, profile_dir: str):
        """One step under the profiler (step_profile.py); its trace stays in profile_dir."""
        from resformer_jax.step_profile import profile_step
        self.hlo = self.hlo or self.compiled.as_text()
        p = profile_step(self.compiled, self.state, self.tokens, self.hlo, profile_dir)
        self.state, self.metrics = p.state, p.metrics
        # Paired with this round's timed step: the ratio cancels the host's drift between rounds.
        self.profiles.append({**p.breakdown, "trace_dir": p.trace_dir,
                              "ratio": p.breakdown["profiled_step_s"] / self.times[-1]})

    def breakdown(self) -> dict | None:
        """The profiled step of median wall time (None when none was profiled)."""
        if not self.profiles:
            return None
        runs = sorted(self.profiles, key=lambda b: b["profiled_step_s"])
        out = {k: v for k, v in runs[len(runs) // 2].items() if k != "ratio"}
        return {**out, "profiled_steps": len(runs),
                "profiled_over_timed_step": round(statistics.median(b["ratio"] for b in self.profiles), 4)}

    def release(self):
        self.state = self.tokens = None

    def report(self, peak, peak_src, peak_median=None) -> dict:
        import jax
        from resformer_jax import metrics
        cfg = self.cfg
        med = statistics.median(self.times)
        tps = cfg.train.global_batch * cfg.data.seq_len / med
        flops = metrics.model_flops(cfg.model, cfg.data.seq_len)
        stats = jax.local_devices()[0].memory_stats() or {}
        return {**self.out, "median_step_s": round(med, 4), "step_s": [round(x, 4) for x in self.times],
                "tokens_per_s": round(tps, 1), "tokens_per_s_per_device": round(tps / jax.device_count(), 1),
                **metrics.mfu(flops, tps, peak),
                **({"mfu_model_vs_median_peak": flops.per_token * tps / peak_median,
                    "peak_flops_median": peak_median} if peak_median else {}),
                # each step against the peak sampled just before it, the median over steps: a shared host's
                # slow spells touch both sides of each ratio alike
                **({"mfu_model_vs_paired_peak": statistics.median(
                    flops.per_token * cfg.train.global_batch * cfg.data.seq_len / t / p
                    for t, p in zip(self.times, self.round_peaks))} if self.round_peaks else {}),
                "peak_flops": peak, "peak_source": peak_src, "flops_per_token": flops.per_token,
                "peak_memory_bytes": stats.get("peak_bytes_in_use", _rss_bytes()),
                "peak_memory_source": "device peak_bytes_in_use" if "peak_bytes_in_use" in stats
                else "process RSS (all variants of this process)",
                "loss": float(self.metrics["loss"]),
                **({"step_breakdown": self.breakdown()} if self.profiles else {})}


def bench_train(cfgs, steps: int, compile_only: bool, interleave: bool = True, attention=None,
                profile_dir: str | None = None, profile_steps: int = 1) -> list[dict]:
    """Compiles every variant, then times `steps` steps of each.

    interleave: the variants take turns step by step (round robin), so a slow
    spell of a shared host slows all of them alike and their ratios stay
    honest; False runs them one after another, holding one state at a time.
    On CPU the matmul peak is sampled again before every round, and the best
    sample (with the start-up measurement) is the MFU denominator: a shared
    host's throughput drifts, and the best it reached is the conservative
    choice (it gives the lower MFU).

    profile_steps > 0: in the last `profile_steps` rounds each variant also runs one step under the profiler
    (interleaved with the timed steps, so host drift touches both alike) and reports the median one as
    `step_breakdown` (step_profile.py); traces go to profile_dir/<variant>[-<dtype> when several]/step<i>
    (a temporary folder, deleted, when None).
    """
    import tempfile
    import jax
    from resformer_jax import metrics
    benches = [TrainBench(c, attention) for c in cfgs]
    if compile_only:
        return [b.out for b in benches]
    tmp = tempfile.TemporaryDirectory() if profile_steps and profile_dir is None else None
    root = profile_dir or (tmp.name if tmp else None)
    on_cpu = jax.devices()[0].platform == "cpu"
    # MFU against the matmul peak at each variant's compute dtype (sampled per dtype present)
    dtypes = list(dict.fromkeys(c.model.dtype for c in cfgs))
    samples = {d: [metrics.measure_cpu_matmul_peak(dtype=d)] if on_cpu else [] for d in dtypes}
    groups = [benches] if interleave else [[b] for b in benches]
    for group in groups:
        for b in group:
            b.warm_up()
        for i in range(steps):
            if on_cpu:
                for d in dict.fromkeys(b.cfg.model.dtype for b in group):
                    samples[d].append(metrics.sample_cpu_matmul_peak(dtype=d))
            for b in group:
                b.timed_step()
                if on_cpu:
                    b.round_peaks.append(samples[b.cfg.model.dtype][-1])
            if i >= steps - profile_steps:
                for b in group:
                    name = b.cfg.model.value_residual + (f"-{b.cfg.model.dtype}" if len(dtypes) > 1 else "")
                    b.profiled_step(os.path.join(root, name, f"step{i}"))
        if not interleave:
            group[0].release()
    if tmp is not None:
        tmp.cleanup()
    out = []
    for b in benches:
        dtype, ss = b.cfg.model.dtype, samples[b.cfg.model.dtype]
        if on_cpu:
            src = (f"best of {len(ss)} {'bf16' if dtype == 'bfloat16' else 'fp32'} matmul throughput samples of "
                   "this host's CPU, taken at start-up and "
                   f"between the timed steps (they ranged {min(ss) / 1e9:.0f}-{max(ss) / 1e9:.0f} GFLOP/s)")
            out.append(b.report(max(ss), src, statistics.median(ss)))
        else:
            out.append(b.report(*metrics.device_peak_flops(dtype)))
    return out


def bench_attention(shapes, impls, dtype) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from resformer_jax import kernels, metrics
    peak, src = metrics.device_peak_flops()
    res = []
    for spec in shapes:
        B, T, H, K, D = (int(x) for x in spec.split(","))
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(ks[0], (B, T, H, D), dtype)
        k = jax.random.normal(ks[1], (B, T, K, D), dtype)
        v = jax.random.normal(ks[2], (B, T, K, D), dtype)
        # Causal forward: 2 matmuls of 2*B*H*T*T*D/2 FLOPs; backward: 2.5x the forward (5 matmuls).
        fwd_flops = 2 * 2 * B * H * T * T * D / 2
        for impl in impls:
            try:
                f = jax.jit(lambda q, k, v, impl=impl: kernels.attention(q, k, v, impl=impl))
                g = jax.jit(jax.grad(lambda q, k, v, impl=impl: kernels.attention(q, k, v, impl=impl)
                                     .astype(jnp.float32).sum(), argnums=(0, 1, 2)))
                times = {}
                for name, fn, flops in (("fwd", f, fwd_flops), ("fwd_bwd", g, 3.5 * fwd_flops)):
                    jax.block_until_ready(fn(q, k, v))
                    ts = []
                    for _ in range(5):
                        t = time.perf_counter()
                        jax.block_until_ready(fn(q, k, v))
                        ts.append(time.perf_counter() - t)
                    s = statistics.median(ts)
                    times[name] = {"ms": round(1e3 * s, 3), "tflops": flops / s / 1e12,
                                   "fraction_of_peak": flops / s / peak}
                res.append({"impl": impl, "shape": [B, T, H, K, D], "dtype": str(dtype.__name__ if hasattr(
                    dtype, "__name__") else dtype), **times, "peak_source": src})
            except Exception as e:  # noqa: BLE001 - a benchmark reports what cannot run
                res.append({"impl": impl, "shape": [B, T, H, K, D], "error": f"{type(e).__name__}: {e}"[:300]})
    return res


def bench_data(cfg, steps: int, step_tokens_per_s: float = 0.0) -> dict:
    """The training iterator (mixture, this host's slice, grain threads and prefetch) as training reads it:
    batches per second after a warm-up, against the tokens per second the train step consumes."""
    import jax
    from resformer_jax.config import validate
    from resformer_jax.data.pipeline import train_iterator
    validate(cfg)
    it = train_iterator(cfg, jax.process_index(), jax.process_count())
    for _ in range(3):  # threads started, prefetch buffer filled
        next(it)
    t = time.perf_counter()
    for _ in range(steps):
        batch = next(it)
    dt = time.perf_counter() - t
    local_tokens = batch.shape[0] * (batch.shape[1] - 1)
    tps = steps * local_tokens / dt
    out = {"source": cfg.data.source, "global_batch": cfg.train.global_batch, "seq_len": cfg.data.seq_len,
           "processes": jax.process_count(), "threads": cfg.data.num_threads, "prefetch": cfg.data.prefetch,
           "batches": steps, "loader_tokens_per_s_per_host": round(tps, 1),
           "loader_batches_per_s": round(steps / dt, 2)}
    if step_tokens_per_s <= 0:
        b = TrainBench(cfg)
        b.warm_up(1)
        for _ in range(3):
            b.timed_step()
        step_tokens_per_s = cfg.train.global_batch * cfg.data.seq_len / statistics.median(b.times)
        out["step_source"] = "timed here (3 steps)"
    else:
        out["step_source"] = "--step_tokens_per_s"
    per_host = step_tokens_per_s / jax.process_count()
    out.update(step_tokens_per_s=round(step_tokens_per_s, 1), loader_over_step=round(tps / per_host, 2))
    return out


def bench_decode(cfg, context, new_tokens, batch) -> dict:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from resformer_jax.model import Transformer
    from resformer_jax.model.decode import generate
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, context + new_tokens)
    model = Transformer(cfg.model)
    params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    prompt = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (batch, context), dtype=np.int32)
    generate(cfg.model, params, prompt[:, :16], max_new_tokens=2, max_len=context + new_tokens)  # compile small
    _, stats = generate(cfg.model, params, prompt, max_new_tokens=new_tokens, max_len=context + new_tokens)
    # A second run measures decoding without compilation.
    _, stats = generate(cfg.model, params, prompt, max_new_tokens=new_tokens, max_len=context + new_tokens)
    return {"variant": cfg.model.value_residual, "context": context, "new_tokens": new_tokens, "batch": batch,
            "kv_cache_bytes": stats["kv_cache_bytes"], "decode_tokens_per_s": round(stats["decode_tokens_per_s"], 2)}


def measure_copy_bandwidth(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s this device reads and writes in an elementwise pass (x + 1 over n_bytes of fp32), best of repeats."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = max(best, 2 * n_bytes / (time.perf_counter() - t))
    return best


def bench_decode_matrix(cfgs, batches, contexts, new_tokens: int, rounds: int) -> list[dict]:
    """Decode tokens/s for every (batch, context) and variant, warm-up excluded, the variants taking turns; with
    the bytes a decode step reads (the weights once, every layer's cached K/V up to the mean context) and the
    fraction of the copy bandwidth that implies, so SVFormer's smaller cache shows as bytes and as time."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from resformer_jax.model import Transformer
    from resformer_jax.model.decode import generate, kv_cache_bytes_per_token
    bandwidth = measure_copy_bandwidth()
    out = []
    for batch in batches:
        for context in contexts:
            runs = []
            for cfg in cfgs:
                m = cfg.copy_and_resolve_references().model
                m.max_seq_len = max(m.max_seq_len, context + new_tokens)
                params = nn.unbox(jax.jit(Transformer(m).init)(jax.random.PRNGKey(0),
                                                               jnp.zeros((1, 8), jnp.int32))["params"])
                prompt = np.random.default_rng(0).integers(0, m.vocab_size, (batch, context), dtype=np.int32)
                generate(m, params, prompt, max_new_tokens=new_tokens, max_len=context + new_tokens)  # compile
                item = jnp.dtype(m.dtype).itemsize
                n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
                weights = (n - m.vocab_size * m.d_model) * item  # the embedding table: one row per token, not read
                cache = kv_cache_bytes_per_token(m) * batch * (context + new_tokens / 2)
                runs.append((m, params, prompt, weights, cache, []))
            for _ in range(rounds):
                for m, params, prompt, _, _, tps in runs:
                    _, st = generate(m, params, prompt, max_new_tokens=new_tokens, max_len=context + new_tokens)
                    tps.append(st["decode_tokens_per_s"])
            for m, _, _, weights, cache, tps in runs:
                med = statistics.median(tps)
                step_bytes = weights + cache  # one decode step serves `batch` tokens
                out.append({"variant": m.value_residual, "batch": batch, "context": context, "new_tokens": new_tokens,
                            "decode_tokens_per_s": round(med, 2), "weight_bytes_per_step": int(weights),
                            "kv_cache_bytes_read_per_step": int(cache),
                            "bytes_read_per_token": round(step_bytes / batch, 1),
                            "memory_bandwidth_bytes_per_s": bandwidth,
                            "fraction_of_bandwidth": step_bytes * (med / batch) / bandwidth})
    return out


def main(argv):
    from resformer_jax import cli
    cli.start()
    if len(argv) < 2 or argv[1] not in ("train", "attention", "decode", "accelerator", "data"):
        raise app.UsageError("usage: python -m resformer_jax.bench {train,attention,decode,accelerator,data} [flags]")
    what = argv[1]
    if what == "accelerator":
        from resformer_jax import accelerator_check
        accelerator_check.main(FLAGS.out)
        return
    if what == "attention":
        import jax.numpy as jnp
        for spec in FLAGS.shapes:
            parts = spec.split(",")
            if len(parts) != 5 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
                print(f"error: --shapes={spec!r}: expected five positive integers B,T,H,K,D (e.g. 4,2048,16,4,64)",
                      file=sys.stderr)
                sys.exit(2)
            if int(parts[2]) % int(parts[3]):
                print(f"error: --shapes={spec!r}: K={parts[3]} kv heads do not divide H={parts[2]} query heads",
                      file=sys.stderr)
                sys.exit(2)
        unknown = [i for i in FLAGS.impls.split(",") if i not in ("auto", "pallas", "cudnn", "splash", "chunked", "xla",
                                                                    "reference")]
        if unknown:
            print(f"error: --impls: unknown {unknown}; choose from pallas, cudnn, splash, chunked, xla, reference",
                  file=sys.stderr)
            sys.exit(2)
        for r in bench_attention(FLAGS.shapes, FLAGS.impls.split(","), jnp.dtype(FLAGS.dtype).type):
            print(json.dumps(r))
        return
    if FLAGS.config is None:
        raise app.UsageError("--config is required")
    if what == "data":
        with cli.exit_on_user_error():
            print(json.dumps(bench_data(FLAGS.config, FLAGS.steps, FLAGS.step_tokens_per_s)))
        return
    modes = FLAGS.compare.split(",") if FLAGS.compare else [FLAGS.config.model.value_residual]
    if what == "train" and not FLAGS.compare_dtypes:
        # model.dtype=auto: measured once, so every compared variant runs in the same dtype
        from resformer_jax.train.setup import resolve_dtype
        with cli.exit_on_user_error():
            resolve_dtype(FLAGS.config, log=lambda m: print(m, file=sys.stderr))
    dtypes = FLAGS.compare_dtypes.split(",") if FLAGS.compare_dtypes else [FLAGS.config.model.dtype]
    cfgs = []
    for mode in modes:
        for dtype in dtypes:
            cfg = FLAGS.config.copy_and_resolve_references()
            cfg.model.value_residual, cfg.model.dtype = mode, dtype
            cfgs.append(cfg)
    # what the ratios are keyed by: the variant, and its dtype where several are compared
    label = (lambda r: f"{r['variant']}/{r.get('dtype')}") if FLAGS.compare_dtypes else (lambda r: r["variant"])
    with cli.exit_on_user_error():
        if what == "train":
            # `auto` is probed once, at the first variant's shapes, and used by every variant.
            from resformer_jax.train.setup import resolve_attention
            attention = resolve_attention(cfgs[0], batch=1, log=lambda m: print(m, file=sys.stderr))
            results = bench_train(cfgs, FLAGS.steps, FLAGS.compile_only, FLAGS.interleave, attention,
                                  FLAGS.profile_dir, FLAGS.profile_steps)
        else:
            if FLAGS.matrix:
                b_text, _, c_text = FLAGS.matrix.partition(":")
                try:
                    batches, contexts = [int(x) for x in b_text.split(",")], [int(x) for x in c_text.split(",")]
                except ValueError:
                    print(f"error: --matrix={FLAGS.matrix!r}: expected BATCHES:CONTEXTS, e.g. 1,16:512,2048",
                          file=sys.stderr)
                    sys.exit(2)
                for r in bench_decode_matrix(cfgs, batches, contexts, FLAGS.new_tokens, FLAGS.rounds):
                    print(json.dumps(r))
                return
            results = [bench_decode(c, FLAGS.context, FLAGS.new_tokens, FLAGS.batch) for c in cfgs]
    for r in results:
        print(json.dumps(r))
    if len(results) > 1:
        base = results[0]
        key = "median_step_s" if what == "train" else "decode_tokens_per_s"
        if key in base:
            ratios = {label(r): round(r[key] / base[key], 4) for r in results}
            extra = {"kv_cache_ratio": {label(r): round(r["kv_cache_bytes"] / base["kv_cache_bytes"], 4)
                                        for r in results}} if what == "decode" else {}
            if what == "train" and FLAGS.interleave and not FLAGS.compile_only:
                # Steps of one round ran back to back: the median of per-round ratios cancels host drift.
                extra["paired_median_step_ratio"] = {label(r): round(statistics.median(
                    a / b for a, b in zip(r["step_s"], base["step_s"])), 4) for r in results}
            print(json.dumps({"ratio_to_" + label(base): {key: ratios}, **extra}))


if __name__ == "__main__":
    from resformer_jax import cli
    cli.check_config_flags(sys.argv)
    app.run(main)
