"""Benchmarks on whatever device is present. Each prints one JSON object per measurement.

  python -m resformer_jax.bench train --config=configs/transformer_82m.py --steps=5 \
      --config.train.global_batch=8 --config.data.seq_len=512 --config.model.dtype=float32 \
      [--compare=none,resformer,svformer] [--compile_only]
  python -m resformer_jax.bench attention --shapes=4,2048,16,16,64 [--impls=xla,pallas,reference] [--dtype=bfloat16]
  python -m resformer_jax.bench decode --config=configs/svformer_82m.py --context=2048 --new_tokens=64 \
      [--compare=none,svformer] [--batch=1]

train: compile seconds, median step seconds, tokens/s (total and per device), MFU in
two conventions (6N with N the non-embedding parameters, and the model's own FLOP
count with causal attention) against the device peak (on CPU: a measured fp32 matmul
peak), and memory: XLA's per-device estimate of the compiled step (arguments +
outputs + temporaries) and the device's peak in use (GPU/TPU) or process RSS (CPU).
"""
from __future__ import annotations

import json
import resource
import statistics
import sys
import time

from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=False)
flags.DEFINE_integer("steps", 5, "Timed steps (after 2 warm-up steps).")
flags.DEFINE_string("compare", None, "Comma-separated value_residual modes to run at the same shapes.")
flags.DEFINE_bool("compile_only", False, "train: only lower and compile; report compile seconds.")
flags.DEFINE_bool("interleave", True, "train --compare: variants take turns step by step (False: one after "
                  "another, one state in memory at a time).")
flags.DEFINE_multi_string("shapes", ["2,1024,8,8,64"], "attention: B,T,H,K,D (repeatable).")
flags.DEFINE_string("impls", "xla,pallas,reference", "attention: impls to time.")
flags.DEFINE_string("dtype", "float32", "attention: input dtype.")
flags.DEFINE_integer("context", 2048, "decode: prompt length.")
flags.DEFINE_integer("new_tokens", 32, "decode: tokens to generate.")
flags.DEFINE_integer("batch", 1, "decode: batch size.")
FLAGS = flags.FLAGS


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class TrainBench:
    """One variant's compiled train step, its state and its timings."""

    def __init__(self, cfg):
        import flax.linen as nn
        import jax
        import jax.numpy as jnp
        import numpy as np
        from resformer_jax.config import validate
        from resformer_jax.model import Transformer
        from resformer_jax.parallel.mesh import (batch_sharding, check_divisibility, logical_shardings, make_mesh,
                                                 replicated)
        from resformer_jax.train.optimizer import make_optimizer
        from resformer_jax.train.step import init_state, make_train_step
        validate(cfg)
        self.cfg = cfg
        mesh = make_mesh(cfg.mesh)
        check_divisibility(cfg, mesh)
        model, tx = Transformer(cfg.model), make_optimizer(cfg.train)
        self._init = lambda r: init_state(model, tx, r, cfg.data.seq_len)  # noqa: E731
        boxed = jax.eval_shape(self._init, jax.random.PRNGKey(0))
        self.state_sh = logical_shardings(boxed, mesh, cfg.mesh)
        bsh = batch_sharding(mesh)
        A = cfg.train.global_batch // (cfg.train.microbatch or cfg.train.global_batch)
        micro_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, ("data", "fsdp"), None))
        step = jax.jit(make_train_step(model, tx, A, micro_sh, cfg.train.loss_chunk_len),
                       in_shardings=(self.state_sh, bsh), out_shardings=(self.state_sh, replicated(mesh)),
                       donate_argnums=(0,))
        self.shape = (cfg.train.global_batch, cfg.data.seq_len + 1)
        abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      nn.unbox(boxed), self.state_sh)
        t0 = time.perf_counter()
        self.compiled = step.lower(abstract_state, jax.ShapeDtypeStruct(self.shape, jnp.int32, sharding=bsh)).compile()
        compile_s = time.perf_counter() - t0
        ma = self.compiled.memory_analysis()
        xla_mem = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                   - ma.alias_size_in_bytes) if ma is not None else None
        self.out = {"variant": cfg.model.value_residual, "scan_layers": cfg.model.scan_layers,
                    "remat": cfg.model.remat, "attention_impl": cfg.model.attention_impl,
                    "num_layers": cfg.model.num_layers, "batch": cfg.train.global_batch,
                    "seq_len": cfg.data.seq_len, "dtype": cfg.model.dtype, "devices": jax.device_count(),
                    "device_kind": jax.devices()[0].device_kind, "compile_s": round(compile_s, 3),
                    "xla_memory_bytes_per_device": xla_mem,
                    "xla_temp_bytes_per_device": ma.temp_size_in_bytes if ma is not None else None}
        self.times, self.state = [], None
        self._tokens = lambda: jax.device_put(  # noqa: E731
            np.random.default_rng(0).integers(0, cfg.model.vocab_size, self.shape, dtype=np.int32), bsh)

    def warm_up(self, steps=2):
        import flax.linen as nn
        import jax
        self.state = jax.jit(lambda r: nn.unbox(self._init(r)), out_shardings=self.state_sh)(jax.random.PRNGKey(0))
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

    def release(self):
        self.state = self.tokens = None

    def report(self, peak, peak_src) -> dict:
        import jax
        from resformer_jax.model.transformer import flops_per_token, param_counts
        cfg = self.cfg
        med = statistics.median(self.times)
        tps = cfg.train.global_batch * cfg.data.seq_len / med
        pc = param_counts(cfg.model)
        fpt = flops_per_token(cfg.model, cfg.data.seq_len)
        stats = jax.local_devices()[0].memory_stats() or {}
        return {**self.out, "median_step_s": round(med, 4), "step_s": [round(x, 4) for x in self.times],
                "tokens_per_s": round(tps, 1), "tokens_per_s_per_device": round(tps / jax.device_count(), 1),
                "mfu_6n": 6 * pc["params_non_embedding"] * tps / peak, "mfu_model": fpt * tps / peak,
                "peak_flops": peak, "peak_source": peak_src, "flops_per_token": fpt,
                "peak_memory_bytes": stats.get("peak_bytes_in_use", _rss_bytes()),
                "peak_memory_source": "device peak_bytes_in_use" if "peak_bytes_in_use" in stats
                else "process RSS (all variants of this process)",
                "loss": float(self.metrics["loss"])}


def bench_train(cfgs, steps: int, compile_only: bool, interleave: bool = True) -> list[dict]:
    """Compiles every variant, then times `steps` steps of each.

    interleave: the variants take turns step by step (round robin), so a slow
    spell of a shared host slows all of them alike and their ratios stay
    honest; False runs them one after another, holding one state at a time.
    On CPU the matmul peak is sampled again before every round, and the best
    sample (with the start-up measurement) is the MFU denominator: a shared
    host's throughput drifts, and the best it reached is the conservative
    choice (it gives the lower MFU).
    """
    import jax
    from resformer_jax import metrics
    benches = [TrainBench(c) for c in cfgs]
    if compile_only:
        return [b.out for b in benches]
    on_cpu = jax.devices()[0].platform == "cpu"
    samples = [metrics.measure_cpu_matmul_peak()] if on_cpu else []
    groups = [benches] if interleave else [[b] for b in benches]
    for group in groups:
        for b in group:
            b.warm_up()
        for _ in range(steps):
            if on_cpu:
                samples.append(metrics.sample_cpu_matmul_peak())
            for b in group:
                b.timed_step()
        if not interleave:
            group[0].release()
    if on_cpu:
        peak = max(samples)
        src = (f"best of {len(samples)} fp32 matmul throughput samples of this host's CPU, taken at start-up and "
               f"between the timed steps (they ranged {min(samples) / 1e9:.0f}-{max(samples) / 1e9:.0f} GFLOP/s)")
    else:
        peak, src = metrics.device_peak_flops()
    return [b.report(peak, src) for b in benches]


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


def main(argv):
    from resformer_jax.runtime import configure_xla
    configure_xla()  # before JAX starts its backend
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)
    if len(argv) < 2 or argv[1] not in ("train", "attention", "decode"):
        raise app.UsageError("usage: python -m resformer_jax.bench {train,attention,decode} [flags]")
    what = argv[1]
    if what == "attention":
        import jax.numpy as jnp
        for r in bench_attention(FLAGS.shapes, FLAGS.impls.split(","), jnp.dtype(FLAGS.dtype).type):
            print(json.dumps(r))
        return
    if FLAGS.config is None:
        raise app.UsageError("--config is required")
    modes = FLAGS.compare.split(",") if FLAGS.compare else [FLAGS.config.model.value_residual]
    cfgs = []
    for mode in modes:
        cfg = FLAGS.config.copy_and_resolve_references()
        cfg.model.value_residual = mode
        if cfg.model.attention_impl == "auto":  # probed once, at the first variant's shapes
            from resformer_jax import kernels
            import jax.numpy as jnp
            if not kernels.auto_probed():
                kernels.probe_auto((1, cfg.data.seq_len, cfg.model.num_heads, cfg.model.d_model // cfg.model.num_heads),
                                   cfg.model.num_kv_heads or cfg.model.num_heads, jnp.dtype(cfg.model.dtype),
                                   lambda m: print(m, file=sys.stderr))
            cfg.model.attention_impl = kernels.resolve_auto()
        cfgs.append(cfg)
    if what == "train":
        results = bench_train(cfgs, FLAGS.steps, FLAGS.compile_only, FLAGS.interleave)
    else:
        results = [bench_decode(c, FLAGS.context, FLAGS.new_tokens, FLAGS.batch) for c in cfgs]
    for r in results:
        print(json.dumps(r))
    if len(results) > 1:
        base = results[0]
        key = "median_step_s" if what == "train" else "decode_tokens_per_s"
        if key in base:
            ratios = {r["variant"]: round(r[key] / base[key], 4) for r in results}
            extra = {"kv_cache_ratio": {r["variant"]: round(r["kv_cache_bytes"] / base["kv_cache_bytes"], 4)
                                        for r in results}} if what == "decode" else {}
            if what == "train" and FLAGS.interleave and not FLAGS.compile_only:
                # Steps of one round ran back to back: the median of per-round ratios cancels host drift.
                extra["paired_median_step_ratio"] = {r["variant"]: round(statistics.median(
                    a / b for a, b in zip(r["step_s"], base["step_s"])), 4) for r in results}
            print(json.dumps({"ratio_to_" + base["variant"]: {key: ratios}, **extra}))


if __name__ == "__main__":
    app.run(main)
