"""The train step as training builds it (train/setup.py), timed: variants and dtypes interleaved step by step,
MFU against the peak (on CPU the matmul throughput sampled next to each step), memory, and the step's time
by group from a real profile (step_profile.py)."""

from __future__ import annotations

import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Any

import jax

from resformer_jax import chips, perf
from resformer_jax.benchmarks.step_profile import profile_step
from resformer_jax.benchmarks.timing import random_tokens
from resformer_jax.compilation.roofline import roofline
from resformer_jax.memory import memory_knobs, memory_precheck
from resformer_jax.resolve import resolve
from resformer_jax.train.setup import build


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class TrainBench:
    """One variant's compiled train step (built by train/setup.py, as training builds it), its state
    and its timings."""

    def __init__(self, cfg, attention=None, log=lambda m: print(m, file=sys.stderr), document_len: int = 0):
        self.log, t0 = log, time.perf_counter()
        self.setup = build(resolve(cfg, attention=attention, log=log))
        self.cfg = cfg = self.setup.cfg  # the run as it runs, typed
        # train.telemetry: time the logged steps' program (the per-layer norms); the others run the plain step
        self.compiled, compile_s, mem = self.setup.compile(telemetry=bool(cfg.train.telemetry))
        # each phase's seconds on stderr: a check cut short by its time limit says where it was
        log(
            f"bench train {cfg.model.value_residual}: built in {time.perf_counter() - t0:.1f} s "
            f"({compile_s:.1f} s compile)"
        )
        self.mem = mem
        self.shape = self.setup.global_batch_shape
        self.out = {
            "variant": cfg.model.value_residual,
            "scan_layers": cfg.model.scan_layers,
            "remat": cfg.model.remat,
            "attention_impl": self.setup.model_cfg.attention_impl,
            "num_layers": cfg.model.num_layers,
            "batch": cfg.train.global_batch,
            "seq_len": cfg.data.seq_len,
            "dtype": cfg.model.dtype,
            "telemetry": bool(cfg.train.telemetry),  # per-layer norms (on every step when compared)
            "document_mask": bool(cfg.data.document_mask),
            "document_len": document_len,  # the batches' mean document length (0: one sequence a row)
            "devices": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind,
            "compile_s": round(compile_s, 3),
            "xla_memory_bytes_per_device": mem.total if mem is not None else None,
            "xla_temp_bytes_per_device": mem.temporaries if mem is not None else None,
        }
        self.times: list[float] = []
        self.profiles: list = []
        self.state: Any = None
        self.hlo: str | None = None
        self.round_peaks: list[float] = []  # CPU: the matmul peak sampled just before each timed step
        self._tokens = lambda: random_tokens(self.shape, cfg.model.vocab_size, self.setup.batch_sh, 0, document_len)

    def warm_up(self, steps=2):

        # a clear error before a step that cannot fit, as training does
        memory_precheck(self.mem, self.cfg.mesh, knobs=memory_knobs(self.cfg, self.setup.mesh.devices.size))
        t0 = time.perf_counter()
        self.state = self.setup.init_state(seed=0)
        self.tokens = self._tokens()
        jax.block_until_ready(self.state)
        t1 = time.perf_counter()
        for _ in range(steps):
            self.state, m = self.compiled(self.state, self.tokens)
        jax.block_until_ready(m)
        self.log(
            f"bench train {self.cfg.model.value_residual}: state initialised in {t1 - t0:.1f} s, {steps} warm-up "
            f"step(s) in {time.perf_counter() - t1:.1f} s"
        )

    def timed_step(self):
        t = time.perf_counter()
        self.state, self.metrics = self.compiled(self.state, self.tokens)
        jax.block_until_ready(self.metrics)
        self.times.append(time.perf_counter() - t)

    def profiled_step(self, profile_dir: str):
        """One step under the profiler (step_profile.py); its trace stays in profile_dir."""
        t0 = time.perf_counter()
        hlo = self.hlo = self.hlo or self.compiled.as_text()
        p = profile_step(self.compiled, self.state, self.tokens, hlo, profile_dir)
        self.state, self.metrics = p.state, p.metrics
        self.log(
            f"bench train {self.cfg.model.value_residual}: a step profiled and read in {time.perf_counter() - t0:.1f} s"
        )
        # Against the fastest unprofiled step so far: a shared host's slow spells only ever lengthen a step, and
        # pairing with one round's step made the ratio as noisy as that round.
        self.profiles.append(
            {**p.breakdown, "trace_dir": p.trace_dir, "ratio": p.breakdown["profiled_step_s"] / min(self.times)}
        )

    def breakdown(self) -> dict | None:
        """The profiled step of median wall time (None when none was profiled)."""
        if not self.profiles:
            return None
        runs = sorted(self.profiles, key=lambda b: b["profiled_step_s"])
        out = {k: v for k, v in runs[len(runs) // 2].items() if k != "ratio"}
        return {
            **out,
            "profiled_steps": len(runs),
            "profiled_over_timed_step": round(statistics.median(b["ratio"] for b in self.profiles), 4),
        }

    def release(self):
        self.state = self.tokens = None

    def bound(self, chip=None) -> dict | None:
        """The compiled bound of this very program (compilation/roofline.py: each op at the chip's datasheet peak or
        bandwidth), by part, so a measured step reads as "measured / bound"; None where the chip's numbers are
        not known (a CPU). `chip`: another chip's numbers (tests)."""
        chip = chip or chips.chip_of_device(jax.devices()[0].device_kind)
        if chip is None or not chip.has_roofline:
            return None
        hlo = self.hlo = self.hlo or self.compiled.as_text()
        r = roofline(hlo, chip)
        return {
            "chip": chip.kind,
            "per_op_bound_ms": round(r.per_op_bound_s * 1e3, 2),
            "by_part_ms": {kind: round(v["bound_s"] * 1e3, 2) for kind, v in r.by_kind().items()},
        }

    def report(self, peak, peak_src, peak_median=None) -> dict:
        cfg = self.cfg
        med = statistics.median(self.times)
        tps = cfg.train.global_batch * cfg.data.seq_len / med
        flops = perf.model_flops(cfg.model, cfg.data.seq_len)
        kept = self.metrics.get("attended_fraction")  # packed documents masked: attention by the pairs kept
        if kept is not None:
            flops = flops.attending(float(kept))
        stats = jax.local_devices()[0].memory_stats() or {}
        return {
            **self.out,
            "median_step_s": round(med, 4),
            "step_s": [round(x, 4) for x in self.times],
            "tokens_per_s": round(tps, 1),
            "tokens_per_s_per_device": round(tps / jax.device_count(), 1),
            **perf.mfu(flops, tps, peak),
            **(
                {"mfu_model_vs_median_peak": flops.per_token * tps / peak_median, "peak_flops_median": peak_median}
                if peak_median
                else {}
            ),
            # each step against the peak sampled just before it, the median over steps: a shared host's
            # slow spells touch both sides of each ratio alike
            **(
                {
                    "mfu_model_vs_paired_peak": statistics.median(
                        flops.per_token * cfg.train.global_batch * cfg.data.seq_len / t / p
                        for t, p in zip(self.times, self.round_peaks)
                    )
                }
                if self.round_peaks
                else {}
            ),
            "peak_flops": peak,
            "peak_source": peak_src,
            "flops_per_token": flops.per_token,
            **({"attended_fraction": round(float(kept), 4)} if kept is not None else {}),
            "peak_memory_bytes": stats.get("peak_bytes_in_use", _rss_bytes()),
            "peak_memory_source": "device peak_bytes_in_use"
            if "peak_bytes_in_use" in stats
            else "process RSS (all variants of this process)",
            "loss": float(self.metrics["loss"]),
            # the allocator settings the process ran with (runtime.host_memory_tunables: huge pages for XLA's
            # buffers on CPU hosts); they move a CPU step by ~7%
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            # the XLA options the step compiled with (runtime.cpu_step_compiler_options: Eigen matmuls on
            # AVX2 CPUs without AVX-512)
            "compiler_options": dict(self.setup.compiler_options),
            **self._profile_report(flops.per_token * cfg.train.global_batch * cfg.data.seq_len / med, peak),
        }

    def _profile_report(self, flops_per_s: float, peak: float) -> dict:
        """The profiled step's breakdown, and what its matmuls' share of the step (step_profile.py: `matmul_s`)
        says of the timed steps: their matmuls' rate (the median step's model FLOPs over its matmul share) and
        the MFU of a step that ran only them. A share, not the profiled seconds: a slow spell of the host during
        the profiled step slows its matmuls and the rest alike."""
        bd = self.breakdown()
        if bd is None:
            return {}
        share = bd["matmul_s"] / bd["profiled_step_s"]
        if not share:
            return {"step_breakdown": bd}
        return {
            "step_breakdown": bd,
            "matmul_flops_per_s_in_step": flops_per_s / share,
            "mfu_model_matmuls_only": flops_per_s / share / peak,
        }


def bench_train(
    cfgs,
    steps: int,
    compile_only: bool,
    interleave: bool = True,
    attention=None,
    profile_dir: str | None = None,
    profile_steps: int = 1,
    document_len: int = 0,
) -> list[dict]:
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

    document_len > 0: every variant's batches are the same packed documents of that mean length (each ended by
    the last token id); a variant with data.document_mask masks them, one without attends across them.
    """
    benches = [TrainBench(c, attention, document_len=document_len) for c in cfgs]
    if compile_only:
        return [b.out for b in benches]
    tmp = tempfile.TemporaryDirectory() if profile_steps and profile_dir is None else None
    root = profile_dir or (tmp.name if tmp else "")
    on_cpu = jax.devices()[0].platform == "cpu"
    # MFU against the matmul peak at each variant's compute dtype (sampled per dtype present)
    dtypes = list(dict.fromkeys(c.model.dtype for c in cfgs))
    samples = {d: [perf.measure_cpu_matmul_peak(dtype=d)] if on_cpu else [] for d in dtypes}
    groups = [benches] if interleave else [[b] for b in benches]
    for group in groups:
        for b in group:
            b.warm_up()
        for i in range(steps):
            if on_cpu:
                for d in dict.fromkeys(b.cfg.model.dtype for b in group):
                    samples[d].append(perf.sample_cpu_matmul_peak(dtype=d))
            for b in group:
                b.timed_step()
                if on_cpu:
                    b.round_peaks.append(samples[b.cfg.model.dtype][-1])
            if i >= steps - profile_steps:
                for b in group:
                    name = b.cfg.model.value_residual + (f"-{b.cfg.model.dtype}" if len(dtypes) > 1 else "")
                    name += "-telemetry" if b.cfg.train.telemetry and len(benches) > 1 else ""
                    name += "-documents" if b.cfg.data.document_mask and len(benches) > 1 else ""
                    b.profiled_step(os.path.join(root, name, f"step{i}"))
        if not interleave:
            group[0].release()
    if tmp is not None:
        tmp.cleanup()
    out = []
    for b in benches:
        dtype, ss = b.cfg.model.dtype, samples[b.cfg.model.dtype]
        if on_cpu:
            src = (
                f"best of {len(ss)} {'bf16' if dtype == 'bfloat16' else 'fp32'} matmul throughput samples of "
                "this host's CPU, taken at start-up and "
                f"between the timed steps (they ranged {min(ss) / 1e9:.0f}-{max(ss) / 1e9:.0f} GFLOP/s)"
            )
            out.append(b.report(max(ss), src, statistics.median(ss)))
        else:
            out.append(b.report(*perf.device_peak_flops(dtype)))
    return out
