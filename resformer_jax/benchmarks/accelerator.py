"""The first thing to run on new hardware: `resformer bench accelerator`.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import attention as jax_gpu_attention

from resformer_jax import kernels, perf
from resformer_jax.benchmarks.attention import time_attention
from resformer_jax.benchmarks.decode import bench_decode_matrix
from resformer_jax.benchmarks.timing import median_seconds
from resformer_jax.benchmarks.train import TrainBench
from resformer_jax.config import RunConfig
from resformer_jax.errors import one_line
from resformer_jax.kernels import attention as dispatch
from resformer_jax.kernels import probe
from resformer_jax.presets import paper_config, tiny_config
from resformer_jax.train.setup import AttentionChoice

GPU_ONLY, TPU_ONLY = ("pallas", "cudnn", "jax_pallas_gpu"), ("splash",)
INTERPRETABLE = ("pallas", "splash")  # Pallas kernels that run (slowly) in interpret mode elsewhere
HALF_ONLY = ("cudnn",)  # cuDNN's fused attention takes fp16/bf16/fp8 inputs only: its fp32 row is not applicable
IMPLS = ("pallas", "cudnn", "jax_pallas_gpu", "splash", "chunked", "xla")
VARIANTS = ("none", "resformer", "svformer", "skipv1")  # vanilla first: the others' ratios are to it
TRAIN_IMPLS = 2  # train-step rows for the fastest impls by the attention rows (each 468M row costs minutes)


def applicable(impl: str, backend: str) -> tuple[bool, str]:
    """(run it for speed here?, why not)."""
    if impl in GPU_ONLY and backend != "gpu":
        return False, f"needs an NVIDIA GPU; backend is {backend!r}"
    if impl in TPU_ONLY and backend != "tpu":
        return False, f"needs a TPU; backend is {backend!r}"
    return True, ""


def _jax_pallas_gpu(q, k, v):
    """JAX's own GPU Pallas flash attention ([B, T, H, D] layout, no GQA: K/V repeated)."""
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    return jax_gpu_attention.mha(q, k, v, segment_ids=None, causal=True, sm_scale=1.0 / np.sqrt(q.shape[-1]))


def attention_fn(impl: str):
    if impl == "jax_pallas_gpu":
        return _jax_pallas_gpu
    return lambda q, k, v: dispatch.attention(q, k, v, causal=True, impl=impl)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))


def _plain_norm(h, scale):
    """XLA's RMSNorm (model/layers.RMSNorm's own path), with the residual stream passed on as the kernels pass it."""
    return h, kernels.plain_rms_norm(h, scale, 1e-5, h.dtype)


def _pallas_norm(h, scale):
    return kernels.rms_norm(h, scale, eps=1e-5, out_dtype=h.dtype, passes=True)


def _norm_fwd_bwd(norm, h, scale, dpass, dy):
    """(y, dh, dscale): the norm's output and the gradients of the stream and of scale, the stream's own gradient
    `dpass` added as a block's residual add gives it."""
    (h_out, y), vjp = jax.vjp(norm, h, scale)
    return (y, *vjp((dpass.astype(h_out.dtype), dy.astype(y.dtype))))


def correctness(impl: str, shape, dtype) -> dict:
    """Max relative error of the output and the three gradients against the fp32 reference."""
    B, T, H, K, D = shape
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q32 = jax.random.normal(ks[0], (B, T, H, D))
    k32, v32 = jax.random.normal(ks[1], (B, T, K, D)), jax.random.normal(ks[2], (B, T, K, D))
    do32 = jax.random.normal(ks[3], (B, T, H, D))

    def fwd_bwd(f, q, k, v, do):
        o, vjp = jax.vjp(f, q, k, v)
        return (o,) + vjp(do.astype(o.dtype))

    want = jax.jit(lambda *a: fwd_bwd(dispatch.reference_attention, *a))(q32, k32, v32, do32)
    cast = [x.astype(dtype) for x in (q32, k32, v32, do32)]
    got = jax.jit(lambda *a: fwd_bwd(attention_fn(impl), *a))(*cast)
    return {name: _rel(g.astype(jnp.float32), w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}


def speed(impl: str, shape, dtype, peak: float, repeats: int = 5) -> dict:
    out = time_attention(attention_fn(impl), shape, dtype, peak, repeats=repeats, seed=1)
    return {name: {**r, "tflops": round(r["tflops"], 3)} for name, r in out.items()}


def _step_row(bench: TrainBench, peak: float) -> dict:
    r = bench.report(peak, "")
    measured = r["peak_memory_bytes"] if r["peak_memory_source"].startswith("device") else None
    bound = bench.bound()
    return {
        "variant": r["variant"],
        "impl": r["attention_impl"],
        "compile_s": round(r["compile_s"], 2),
        "step_s": round(r["median_step_s"], 4),
        "tokens_per_s": r["tokens_per_s"],
        "mfu_6n": round(r["mfu_6n"], 4),
        "mfu_model": round(r["mfu_model"], 4),
        "loss": r["loss"],
        "xla_memory_estimate_bytes": r["xla_memory_bytes_per_device"],
        "measured_peak_bytes": measured,
        "measured_peak_source": "device peak_bytes_in_use" if measured is not None else "not reported on CPU",
        # the compiled bound of this same program on this chip, by part: "measured / bound" in one column
        "bound": bound,
        "measured_over_bound": round(r["median_step_s"] * 1e3 / bound["per_op_bound_ms"], 3) if bound else None,
    }


def train_step(cfg, impl: str, steps: int, peak: float, log=lambda s: None) -> dict:
    """One impl's train step, built as training builds it (benchmarks/train.py's TrainBench)."""
    bench = TrainBench(cfg, AttentionChoice(impl, {}, False), log=log)
    bench.warm_up(1)
    for _ in range(steps):
        bench.timed_step()
    row = _step_row(bench, peak)
    bench.release()  # one 468M state on the device at a time
    return row


def variant_steps(cfg, impl: str, steps: int, peak: float, log=lambda s: None) -> dict:
    """Vanilla, ResFormer, SVFormer and SkipV1Former at the same setting, taking turns step by step (a slow spell
    of the device touches each alike); each step's ratio to vanilla's in the same round, the median of them."""
    benches = []
    for mode in VARIANTS:
        c = cfg.copy_and_resolve_references()
        c.model.value_residual = mode
        benches.append(TrainBench(c, AttentionChoice(impl, {}, False), log=log))
    for b in benches:
        b.warm_up(1)
    for _ in range(steps):
        for b in benches:
            b.timed_step()
    rows = [_step_row(b, peak) for b in benches]
    for row, b in zip(rows, benches):
        row["paired_step_ratio_to_vanilla"] = round(
            statistics.median(t / t0 for t, t0 in zip(b.times, benches[0].times)), 4
        )
        b.release()
    return {"impl": impl, "rows": rows}


def device_target_config() -> str | None:
    """This GPU's own XLA target config (GpuTargetConfigProto text), the format of the specs
    `resformer compile` ships in resformer_jax/compilation/gpu_specs/: the first real run of this check
    records the device's numbers so the shipped spec can be compared with them. None off GPU."""
    if jax.default_backend() != "gpu":
        return None
    try:
        from jax._src.lib import xla_client

        return str(xla_client.get_topology_for_devices(jax.devices()).target_config)
    except Exception as e:
        return f"unavailable: {type(e).__name__}: {e}"


def _section(report: dict, name: str, save, fn) -> None:
    """Run one part of the check: its result (or its failure, in one line) and its seconds go into the report,
    which is saved after every part, so a check cut short still leaves what it measured."""
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:
        report[name] = {"status": f"failed: {one_line(e, 300)}"}
    report["seconds"][name] = round(time.perf_counter() - t0, 1)
    save(report)


def check(log=lambda s: print(s, file=sys.stderr), train_steps: int = 3, save=lambda report: None) -> dict:
    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    peak, peak_src = perf.device_peak_flops()
    report = {
        "device_kind": jax.devices()[0].device_kind,
        "backend": backend,
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "peak_flops": peak,
        "peak_source": peak_src,
        "reduced_shapes": on_cpu,
        "target_config": device_target_config(),
        "complete": False,  # True once every part below has run
        "seconds": {},
    }
    # The 468M attention shape per device (paper Table 4: 16 heads, head_dim 64, T = 2,048), reduced on CPU.
    speed_shape = (1, 256, 4, 4, 64) if on_cpu else (4, 2048, 16, 16, 64)
    check_shape = (1, 128, 4, 2, 64)  # correctness: GQA, small enough to run interpreted

    def attention():
        rows = []
        for impl in IMPLS:
            ok, why = applicable(impl, backend)
            row = {"impl": impl}
            if not ok and impl not in INTERPRETABLE:
                row["status"] = f"not applicable: {why}"
                rows.append(row)
                continue
            try:
                dtypes = ("bfloat16",) if impl in HALF_ONLY else ("float32", "bfloat16")
                row["max_rel_error"] = {d: correctness(impl, check_shape, jnp.dtype(d)) for d in dtypes}
                if ok:
                    row["speed_bf16"] = speed(impl, speed_shape, jnp.bfloat16, peak)
                    row["status"] = "ok"
                else:
                    row["status"] = f"correctness checked interpreted; speed not applicable: {why}"
            except Exception as e:
                row["status"] = f"failed: {one_line(e, 300)}"
            rows.append(row)
            log(f"attention {impl:>15}: {row['status']}")
        return {"check_shape": check_shape, "speed_shape": speed_shape, "rows": rows}

    def norm():
        # one row block of the 468M's layers: 16 sequences of 2,048 tokens a GPU, d_model 1,024 (reduced on CPU)
        N, E = (256, 128) if on_cpu else (16 * 2048, 1024)
        ks = jax.random.split(jax.random.PRNGKey(2), 4)
        h32, dpass32, dy32 = (jax.random.normal(k, (1, N, E)) for k in ks[:3])
        scale = 1.0 + 0.1 * jax.random.normal(ks[3], (E,))
        want = jax.jit(functools.partial(_norm_fwd_bwd, _plain_norm))(h32, scale, dpass32, dy32)
        bf16 = [h32.astype(jnp.bfloat16), scale, dpass32.astype(jnp.bfloat16), dy32.astype(jnp.bfloat16)]
        rows = []
        for impl, fn in (("pallas", _pallas_norm), ("xla", _plain_norm)):
            row: dict = {"impl": impl}
            try:
                run = jax.jit(functools.partial(_norm_fwd_bwd, fn))
                got = run(h32, scale, dpass32, dy32)
                row["max_rel_error_fp32"] = {n: _rel(g, w) for n, g, w in zip(("y", "dh", "dscale"), got, want)}
                row["fwd_bwd_ms_bf16"] = round(1e3 * median_seconds(run, *bf16), 4)
                row["status"] = "ok" if backend == "gpu" or impl == "xla" else "interpreted: not a GPU's speed"
            except Exception as e:
                row["status"] = f"failed: {one_line(e, 300)}"
            rows.append(row)
            log(f"norm {impl:>6}: {row['status']}, {row.get('fwd_bwd_ms_bf16')} ms forward + backward")
        return {"rows_x_d_model": [N, E], "rows": rows}

    def auto():
        B, T, H, K, D = speed_shape
        # timed as a ResFormer run's auto times them: on its layers' value mix (the variants below run this choice)
        choice, rejected = probe.probe_auto((B, T, H, D), K, jnp.bfloat16, log_fn=log, value_mix=True)
        return {"choice": choice, "rejected": rejected, "shape": speed_shape, "timed_with_value_mix": True}

    cfg = tiny_config("resformer") if on_cpu else paper_config("468m", "resformer")
    described = "tiny (CPU)"
    if not on_cpu:  # the paper config as shipped for 8x H100, its microbatch per device on each device here
        per_device = cfg.train.microbatch // 8
        cfg.train.global_batch, cfg.train.microbatch = per_device * jax.device_count(), 0
        described = (
            f"resformer_468m as shipped (remat={cfg.model.remat}, scan_layers={cfg.model.scan_layers}), "
            f"{per_device} sequences per device"
        )
    cfg.mesh.data, cfg.mesh.fsdp = -1, 1

    def fastest_impls() -> list[str]:
        """The impls that passed, fastest forward + backward first (the comparison kernel is no config impl)."""
        rows = [
            r
            for r in report["attention"].get("rows", [])
            if r["status"] == "ok" and r["impl"] != "jax_pallas_gpu" and "speed_bf16" in r
        ]
        return [r["impl"] for r in sorted(rows, key=lambda r: r["speed_bf16"]["fwd_bwd"]["ms"])]

    def train():
        steps = []
        impls = fastest_impls()
        for impl in impls[: TRAIN_IMPLS if not on_cpu else len(impls)]:
            try:
                steps.append(train_step(cfg.copy_and_resolve_references(), impl, train_steps, peak, log))
            except Exception as e:
                steps.append({"impl": impl, "status": f"failed: {one_line(e, 300)}"})
            log(f"train step {impl:>8}: {steps[-1]}")
            report["train"] = {"steps": steps, "status": "running"}
            save(report)
        return {
            "config": described,
            "batch": cfg.train.global_batch,
            "seq_len": cfg.data.seq_len,
            "steps": steps,
            "impls_not_stepped": impls[len(steps) :],
        }

    def variants():
        impl = report.get("auto", {}).get("choice") or (fastest_impls() or ["xla"])[0]
        out = {"config": described, **variant_steps(cfg, impl, train_steps, peak, log)}
        for row in out["rows"]:
            log(
                f"variant {row['variant']:>9}: {row['step_s']:.4f} s/step, MFU {row['mfu_model']:.3f}, "
                f"{row['paired_step_ratio_to_vanilla']:.4f}x vanilla (paired), bound {row['bound']}"
            )
        return out

    def decoding():
        # the decode engine's matrix: batch 1 and 64 (CPU: 1 and 4) at 2,048 tokens of context, vanilla and SVFormer
        # taking turns, each row's bytes a step against the memory bandwidth measured in this process
        dcfg = tiny_config("none") if on_cpu else paper_config("468m", "none")
        batches, context, new = ((1, 4), 64, 8) if on_cpu else ((1, 64), 2048, 32)  # 8 steps a readback: 3 timed
        models = [RunConfig.of(dcfg).model.replace(value_residual=v) for v in ("none", "svformer")]
        rows = list(bench_decode_matrix(models, batches, (context,), new, rounds=1, prefill=False, log=log))
        for r in rows:  # what the batch holds in the cache, as the table prints it
            r["kv_cache_bytes"] = r["kv_cache_bytes_held_per_token"] * r["batch"] * (context + new)
        return rows

    # decode before the train steps: the train rows are the longest part, and a check cut short keeps the rest
    parts = (
        ("attention", attention),
        ("norm", norm),
        ("auto", auto),
        ("decode", decoding),
        ("train", train),
        ("variants", variants),
    )
    for name, fn in parts:
        _section(report, name, save, fn)
    report["complete"] = True
    save(report)
    return report


def table(report: dict) -> str:
    lines = [
        f"{report['device_kind']} ({report['backend']}, {report['devices']} devices), peak "
        f"{report['peak_flops'] / 1e12:.1f} TFLOP/s ({report['peak_source']})"
        + ("  [reduced shapes: CPU]" if report["reduced_shapes"] else "")
        + ("" if report["complete"] else "  [INCOMPLETE]")
    ]
    lines.append(f"{'impl':>15} {'err fp32':>9} {'err bf16':>9} {'fwd ms':>8} {'fwd+bwd ms':>11}  status")
    for r in report.get("attention", {}).get("rows", []):
        err = r.get("max_rel_error", {})
        e32, e16 = (max(err[d].values()) if d in err else float("nan") for d in ("float32", "bfloat16"))
        sp = r.get("speed_bf16", {})
        lines.append(
            f"{r['impl']:>15} {e32:9.1e} {e16:9.1e} {sp.get('fwd', {}).get('ms', float('nan')):8.2f} "
            f"{sp.get('fwd_bwd', {}).get('ms', float('nan')):11.2f}  {r['status'][:60]}"
        )
    for r in report.get("norm", {}).get("rows", []):
        err = max(r.get("max_rel_error_fp32", {}).values(), default=float("nan"))
        lines.append(
            f"{'norm ' + r['impl']:>15} {err:9.1e} {'':>9} {'':>8} {r.get('fwd_bwd_ms_bf16', float('nan')):11.2f}"
            f"  {r['status'][:60]}"
        )
    for name in ("attention", "norm", "auto", "decode", "train", "variants"):
        part = report.get(name)
        if isinstance(part, dict) and str(part.get("status", "")).startswith("failed"):
            lines.append(f"{name}: {part['status']}")
    if "choice" in report.get("auto", {}):
        lines.append(f"auto chose {report['auto']['choice']!r}")
    for s in report.get("train", {}).get("steps", []):
        if "step_s" in s:
            lines.append(
                f"train {s['impl']:>8}: {s['step_s']:.3f} s/step, {s['tokens_per_s']:,.0f} tok/s, MFU "
                f"{s['mfu_model']:.3f} (model) {s['mfu_6n']:.3f} (6N), XLA estimate "
                f"{(s['xla_memory_estimate_bytes'] or 0) / 2**30:.2f} GiB, measured peak "
                + (f"{s['measured_peak_bytes'] / 2**30:.2f} GiB" if s["measured_peak_bytes"] else "n/a")
                + (
                    f", bound {s['bound']['per_op_bound_ms']:.1f} ms (measured/bound {s['measured_over_bound']:.2f})"
                    if s.get("bound")
                    else ""
                )
            )
        else:
            lines.append(f"train {s['impl']:>8}: {s['status']}")
    for s in report.get("variants", {}).get("rows", []):
        b = s["bound"]
        lines.append(
            f"{s['variant']:>9} ({s['impl']}): {s['step_s']:.4f} s/step, MFU {s['mfu_model']:.3f} (model), "
            f"{s['paired_step_ratio_to_vanilla']:.4f}x vanilla's step (paired)"
            + (
                f"; bound {b['per_op_bound_ms']:.1f} ms (gemm {b['by_part_ms']['gemm']:.1f}, attention "
                f"{b['by_part_ms']['kernel']:.1f}, fusions {b['by_part_ms']['fusion']:.1f}), measured/bound "
                f"{s['measured_over_bound']:.2f}"
                if b
                else ""
            )
        )
    for d in report.get("decode", []) if isinstance(report.get("decode"), list) else []:
        lines.append(
            f"decode {d['variant']:>8} batch {d['batch']:>3}: {d['decode_tokens_per_s']:,.1f} tok/s, "
            f"{d['fraction_of_bandwidth']:.2f} of the copy / {d.get('fraction_of_read_bandwidth', 0):.2f} of the read "
            f"bandwidth, KV cache "
            f"{d['kv_cache_bytes'] / 2**20:.1f} MiB at context {d['context']}"
        )
    return "\n".join(lines)


def main(out: str | None = None) -> dict:
    from resformer_jax.storage import run_path, write_text_atomic

    def save(report):  # after every part: a check cut short keeps what it measured, marked "complete": false
        if out:  # local or gs:// / s3://
            write_text_atomic(run_path(out), json.dumps(report, indent=1, default=float))

    report = check(save=save)
    print(json.dumps(report, default=float))
    print(table(report), file=sys.stderr)
    return report
