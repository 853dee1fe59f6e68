"""Every step a run compiles, compiled for hardware this machine does not have (ahead of time).

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from resformer_jax import perf
from resformer_jax.chips import chip_named
from resformer_jax.compilation.ptxas import kernel_resources
from resformer_jax.compilation.roofline import chip_for, roofline
from resformer_jax.compilation.targets import Target
from resformer_jax.config import REMAT_POLICIES, RunConfig, set_dotted
from resformer_jax.errors import UserError
from resformer_jax.kernels.names import compiling_for
from resformer_jax.memory import MemoryPrecheckError, memory_knobs, memory_line, memory_precheck
from resformer_jax.model.transformer import attended_fraction, cache_bytes_per_token, needs_unrolled
from resformer_jax.resolve import resolve
from resformer_jax.train.setup import build

STEPS = ("train", "eval", "decode")

# Custom-call targets in a compiled program, by what they are.
KERNEL_NAMES = {
    "__gpu$xla.gpu.triton": "Triton (Pallas)",
    "tpu_custom_call": "Mosaic TPU (Pallas)",
}
# What lowers the decode programs' memory.
DECODE_KNOBS = (
    "the decode engine's cache holds --decode_batch sequences of --prompt_len tokens: lower either, "
    "or --steps=train,eval to check training alone"
)
ELF_MAGIC = b"\x7fELF"  # GPU machine code (cubin) embedded in a serialized executable
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


class AotUnavailable(UserError, RuntimeError):
    """The packages that compile for this target are not installed; the message names the extra."""


class CompileError(UserError, RuntimeError):
    """The target's compiler refused a step (a kernel over its on-chip memory, say); one line says what."""


@dataclasses.dataclass
class CompiledStep:
    name: str  # train | eval | decode_prefill | decode_token
    seconds: float
    memory: perf.StepMemory | None
    custom_calls: dict  # custom-call target -> count in the compiled program
    machine_code: str  # what the executable carries (GPU ELF images, TPU program bytes)
    fits: bool
    problem: str = ""  # the one-line message where it does not fit
    roofline: dict | None = None  # compilation/roofline.py's report of the compiled program (None: chip unknown)
    kernel_resources: list | None = None  # GPU: each Triton kernel's registers and spills (compilation/ptxas.py)
    decode: dict | None = None  # decode_token: rows, context, cache bytes, the tokens/s bound on one device

    @property
    def kernels(self) -> list[str]:
        return sorted({KERNEL_NAMES.get(k, k) for k in self.custom_calls if k in KERNEL_NAMES or "cudnn" in k})

    def to_json(self) -> dict:
        mem = dataclasses.asdict(self.memory) | {"total": self.memory.total} if self.memory else None
        optional = {"problem": self.problem, "roofline": self.roofline, "decode": self.decode}
        return {
            "step": self.name,
            "compile_seconds": round(self.seconds, 2),
            "memory_per_device": mem,
            "fits": self.fits,
            "kernels": self.kernels,
            "custom_calls": self.custom_calls,
            "machine_code": self.machine_code,
            **{k: v for k, v in optional.items() if v},
            **({"kernel_resources": self.kernel_resources} if self.kernel_resources is not None else {}),
        }


@dataclasses.dataclass
class CompileReport:
    target: Target
    attention_impl: str
    dtype: str
    mesh: dict
    microbatch: int
    remat: str
    steps: list[CompiledStep]
    estimate: dict  # --mode=summary's analytic estimate per device (train step)
    documents: dict | None = None  # --documents: the packing the bounds count ({mean_len, attended_fraction})
    run: dict = dataclasses.field(default_factory=dict)  # the run's size: run_size()

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.steps)

    @property
    def first_problem(self) -> str:
        return next((s.problem for s in self.steps if not s.fits), "")

    def to_json(self) -> dict:
        t = self.target
        train = next((s for s in self.steps if s.name == "train"), None)
        est = self.estimate.get("total")
        return {
            "target": t.name,
            "hardware": t.hardware,
            "platform": t.platform,
            "devices": t.num_devices,
            "device_memory_bytes": t.hbm_bytes,
            "device_memory_source": t.hbm_source,
            "attention_impl": self.attention_impl,
            "dtype": self.dtype,
            "mesh": self.mesh,
            "microbatch": self.microbatch,
            "remat": self.remat,
            "fits": self.fits,
            "steps": [s.to_json() for s in self.steps],
            "documents": self.documents,
            "run": self.run,
            "at_the_bound": self.at_the_bound(),
            "summary_estimate_bytes": est,
            "summary_estimate_vs_compiled": (
                round(est / train.memory.total, 3) if est and train and train.memory and train.memory.total else None
            ),
        }

    def at_the_bound(self) -> dict | None:
        """The whole cluster's tokens a second at the train step's bound, and the days to the run's token budget
        (train.steps steps) at the bound and at 0.6 of it; None without a train step's bound."""
        train = next((s for s in self.steps if s.name == "train"), None)
        bound = ((train.roofline or {}).get("per_op_bound_s") if train else None) or 0.0
        if not bound or not self.run:
            return None
        tokens_per_s = self.run["tokens_a_step"] / bound
        days = self.run["token_budget"] / tokens_per_s / 86400
        return {"tokens_per_s": tokens_per_s, "days": days, "days_at_0_6": days / 0.6}

    def lines(self) -> list[str]:
        t, gib = self.target, (lambda b: f"{b / 2**30:.2f} GiB")
        out = [
            f"{t.hardware}: {t.num_devices} devices, {gib(t.hbm_bytes)} each ({t.hbm_source}); mesh "
            f"{self.mesh}, attention {self.attention_impl}, {self.dtype}, remat={self.remat}, microbatch "
            f"{self.microbatch}"
        ]
        if self.documents:
            out.append(
                f"  packed documents of mean length {self.documents['mean_len']} (geometric): attention keeps "
                f"{self.documents['attended_fraction']:.3f} of the causal pairs; the bounds count the Pallas kernels' "
                "blocks skipped at that packing and the MFU ceilings the pairs kept (other kernels skip none)"
            )
            for st in self.steps:
                whole = (st.roofline or {}).get("per_op_bound_s_whole_sequences")
                if whole:
                    out.append(f"  {st.name}: bound {whole * 1e3:.1f} ms with no block skipped (the upper bound)")
        for s in self.steps:
            where = "fits" if s.fits else "DOES NOT FIT"
            mem = memory_line(s.memory, t.hbm_bytes) if s.memory else "memory not reported"
            out.append(
                f"  {s.name:<15} {where:<12} {mem}; compiled in {s.seconds:.1f} s; kernels: "
                f"{', '.join(s.kernels) or 'none (XLA ops only)'}; {s.machine_code}"
            )
            for k in s.kernel_resources or []:
                spill = (
                    f"SPILLS {k['spill_store_bytes']} bytes stored / {k['spill_load_bytes']} loaded per thread"
                    if k["spill_store_bytes"] or k["spill_load_bytes"]
                    else "no spills"
                )
                out.append(f"    kernel {k['kernel']}: {k['registers']} registers, {spill} (ptxas -v)")
            out.extend("    " + ln for ln in roofline_lines(s.roofline))
        if self.estimate.get("total"):
            train = next((s for s in self.steps if s.name == "train" and s.memory), None)
            ratio = (
                f" ({self.estimate['total'] / train.memory.total:.2f}x the compiled train step)"
                if train and train.memory
                else ""
            )
            out.append(f"  --mode=summary's estimate: {gib(self.estimate['total'])} per device{ratio}")
        for s in self.steps:  # the verdict last, one line a step
            r, d = s.roofline or {}, s.decode or {}
            line = f"verdict {s.name}: " + ("DOES NOT FIT" if not s.fits else "fits")
            line += f" ({gib(s.memory.total)} of {gib(t.hbm_bytes)})" if s.fits and s.memory else ""
            line += f"; bound {r['per_op_bound_s'] * 1e3:.1f} ms" if r.get("per_op_bound_s") else ""
            line += f"; MFU ceiling {r['mfu_ceiling_model']:.3f}" if r.get("mfu_ceiling_model") is not None else ""
            if d.get("tokens_per_s_bound"):
                rows = f"{d['rows']} sequence{'s' if d['rows'] != 1 else ''}"
                line += f"; {d['tokens_per_s_bound']:,.0f} tokens/s bound on one device ({rows} at "
                line += f"{d['context_tokens']} tokens of context"
                line += f", run as {d['rows_run']} rows" if d.get("rows_run", d["rows"]) != d["rows"] else ""
                line += f", a paged cache of {gib(d['kv_cache_bytes'])})"
            out.append(line)
        b = self.at_the_bound()
        if b:
            out.append(
                f"at the bound: {b['tokens_per_s']:,.0f} tokens/s over the {t.num_devices} devices; the run's "
                f"{self.run['token_budget'] / 1e9:,.1f}B tokens ({self.run['steps']:,} steps) in {b['days']:.1f} days, "
                f"{b['days_at_0_6']:.1f} days at 0.6 of the bound"
            )
        return out


def run_size(cfg) -> dict:
    """What the compile table reports of the run beside the compiled steps: its size, its step and its budget."""
    f = perf.model_flops(cfg.model, cfg.data.seq_len)
    tokens_a_step = cfg.train.global_batch * cfg.data.seq_len
    return {
        "variant": cfg.model.value_residual,
        "params": f.params_total,
        "seq_len": cfg.data.seq_len,
        "global_batch": cfg.train.global_batch,
        "tokens_a_step": tokens_a_step,
        "steps": cfg.train.steps,
        "token_budget": cfg.train.steps * tokens_a_step,
        "kv_cache_bytes_per_token": cache_bytes_per_token(cfg.model),
    }


def roofline_lines(r: dict | None, top: int = 10) -> list[str]:
    """The roofline report as a short table for people (the JSON holds all of it)."""
    if not r:
        return []
    c = r["chip"]
    mfu = (
        f"MFU ceiling {r['mfu_ceiling_model']:.3f} (model FLOPs) / {r['mfu_ceiling_6n']:.3f} (6N)"
        if r.get("mfu_ceiling_model") is not None
        else "no MFU (not a training step)"
    )
    out = [
        f"roofline ({r['label']}): {r['flops_per_device'] / 1e12:.1f} TFLOP, {r['hbm_bytes_per_device'] / 1e9:.0f} GB "
        f"HBM, {r['collective_bytes_per_device'] / 1e9:.2f} GB collectives per device; per-op bound "
        f"{r['per_op_bound_s'] * 1e3:.1f} ms -> {mfu}; whole-program bound {r['program_bound_s'] * 1e3:.1f} ms; "
        f"{c['kind']} at {c['peak_flops'] / 1e12:.0f} TFLOP/s, {c['hbm_bytes_per_s'] / 1e12:.2f} TB/s ({c['source']})"
    ]
    if r.get("unknown_trip_counts"):
        out.append(
            f"WARNING: {r['unknown_trip_counts']} loop(s) of the program have no trip count the roofline can read and "
            "are counted once: the bound above is too low (compare it with nothing)"
        )
    if r.get("xla_cost_analysis"):
        x = r["xla_cost_analysis"]
        out.append(
            f"the compiler's own cost_analysis(): {x['flops'] / 1e12:.1f} TFLOP ({x['flops_ratio']:.2f}x), "
            f"{x['bytes'] / 1e9:.0f} GB accessed ({x['bytes_ratio']:.2f}x)"
        )
    out.append(f"{'part':<11}{'executions':>11}{'TFLOP':>9}{'GB':>9}{'bound ms':>10}")
    for kind, k in r["by_kind"].items():
        out.append(
            f"{kind:<11}{k['executions']:>11}{k['flops'] / 1e12:>9.1f}{k['bytes'] / 1e9:>9.1f}"
            f"{k['bound_s'] * 1e3:>10.1f}"
            + ("  (on the links; overlapped, not in the bound)" if kind == "collective" else "")
        )
    out.append(f"the {top} costliest computations under the bound (an op's copies merged):")
    for o in r["top_ops"][:top]:
        copies = f" (+{o['copies'] - 1} copies)" if o.get("copies", 1) > 1 else ""
        out.append(
            f"  {o['bound_s'] * 1e3:7.2f} ms  {o['kind']:<7} x{o['executions']:<4} {o['name']}{copies}  "
            f"{o['scope'] or '(no model scope)'}"
        )
    return out


def step_roofline(
    compiled, hlo: str, target: Target, model_flops: tuple[float, float] | None, documents=None
) -> dict | None:
    """The compiled step's roofline report on the target's chip, with the model's FLOPs per device (both
    conventions) for the MFU ceilings; where the compiler's cost_analysis() answers (libtpu), how the two agree.
    `documents`: the packing the kernels' document skipping is counted at (roofline.roofline)."""
    chip = chip_for(target.kind)
    if chip is None:
        return None
    r = roofline(hlo, chip, documents)
    rep = r.report(*(model_flops or (0.0, 0.0)))
    if documents is not None:  # the same program with no block skipped by documents: the upper bound
        rep["per_op_bound_s_whole_sequences"] = roofline(hlo, chip).per_op_bound_s
    if model_flops is None:
        rep.pop("model_flops_per_device")
        for k in ("mfu_ceiling_model", "mfu_ceiling_6n", "mfu_ceiling_model_program_bound"):
            rep[k] = None
    try:
        xla = compiled.cost_analysis()
        xla = xla[0] if isinstance(xla, (list, tuple)) else xla
    except Exception:
        xla = None
    if xla and xla.get("flops"):
        rep["xla_cost_analysis"] = {
            "flops": float(xla["flops"]),
            "bytes": float(xla.get("bytes accessed", 0.0)),
            "flops_ratio": float(xla["flops"]) / max(r.flops, 1.0),
            "bytes_ratio": float(xla.get("bytes accessed", 0.0)) / max(r.hbm_bytes, 1.0),
        }
    return rep


def check_packages(platform: str):
    """AotUnavailable naming the extra where the target's compiler is not installed."""
    need = {"tpu": ("libtpu", "jax[tpu]"), "cuda": ("jax_cuda12_plugin", "jax[cuda12-local] and ptxas")}[platform]
    if importlib.util.find_spec(need[0]) is None:
        raise AotUnavailable(
            f"compiling for {platform} needs {need[1]}, which is not installed here; "
            "pip install -e '.[aot]' (about 2 GB)"
        )
    platforms = jax.config.jax_platforms  # type: ignore[attr-defined]
    if platform == "cuda" and (platforms or "").strip().lower() != "cpu":
        raise AotUnavailable(
            "compiling for cuda needs JAX_PLATFORMS=cpu set before JAX starts ("
            "`resformer compile` sets it); otherwise the CUDA plugin looks for a local GPU"
        )


def _machine_code(compiled, platform: str) -> str:
    try:
        blob = compiled.runtime_executable().serialize()
    except Exception as e:
        return f"executable not serialisable here ({type(e).__name__})"
    if platform == "cuda":
        images = blob.count(ELF_MAGIC)
        return f"{images} GPU ELF image(s) in a {len(blob) / 2**20:.1f} MiB executable"
    return f"a {len(blob) / 2**20:.1f} MiB TPU executable"


def _refusal(e: Exception, what: str, target: Target, knobs: str) -> Exception:
    """The target compiler's error as one line: over memory -> the precheck's knobs; a kernel over its on-chip
    memory -> the kernel and the block sizes; anything else -> its first line."""
    text = str(e)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    if "Shared memory size limit exceeded" in text:
        m = re.search(r"Shared memory size limit exceeded[^\n]*", text)
        assert m is not None
        return CompileError(
            f"{what} does not compile for {target.hardware}: a Triton kernel needs more shared "
            f"memory than the GPU has ({m.group(0)}); the attention kernel's blocks are too large "
            "(kernels/pallas_attention.choose_blocks shrinks them to its budget; a hand-set "
            "block_q/block_k or head_dim above 256 bypasses it)"
        )
    if "RESOURCE_EXHAUSTED" in text and ("HBM" in text or "hbm" in text or "memory" in text.lower()):
        m = re.search(r"[^\n]*(?:exceeds available|Ran out of memory)[^\n]*", text)
        said = (m.group(0).strip() if m else first)[:400]
        return MemoryPrecheckError(f"{what} does not fit {target.hardware}: the compiler says: {said}; {knobs}")
    if "VMEM" in text or "vmem" in text:
        return CompileError(
            f"{what} does not compile for {target.hardware}: a Mosaic kernel exceeds the TPU's "
            f"on-chip memory (VMEM): {first[:400]}"
        )
    return CompileError(f"{what} does not compile for {target.hardware}: {type(e).__name__}: {first[:400]}")


@contextlib.contextmanager
def _without_persistent_cache():
    """JAX's persistent compilation cache cannot hold a compile-only client's program (reading it back fails:
    "PjRtCompiler must be constructed with a Client"), so writing one costs time and megabytes of disk. JAX decides
    once per process whether the cache is used, so the decision is reset on the way in and on the way out."""
    was = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]
    jax.config.update("jax_enable_compilation_cache", False)
    jax_compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        jax_compilation_cache.reset_cache()


def compile_step(
    name: str,
    jitted,
    args: tuple,
    target: Target,
    cfg,
    kwargs: dict | None = None,
    log: Callable[[str], Any] = print,
    model_flops: tuple[float, float] | None = None,
    documents=None,
) -> CompiledStep:
    """Lowers and compiles one step for the target; the memory verdict as the trainer's precheck gives it."""
    t0 = time.perf_counter()
    knobs = DECODE_KNOBS if name.startswith("decode") else memory_knobs(cfg, target.num_devices)
    # GPU: XLA writes the program's PTX here, for ptxas' report of the Triton kernels' registers
    dump = tempfile.mkdtemp(prefix="resformer_ptx_") if target.platform == "cuda" else None
    try:
        try:
            with compiling_for(target.platform, target.kind), _without_persistent_cache():
                compiled = jitted.lower(*args, **(kwargs or {})).compile({"xla_dump_to": dump} if dump else None)
        except UserError:
            raise
        except Exception as e:
            err = _refusal(e, f"the {name} step", target, knobs)
            if isinstance(err, MemoryPrecheckError):
                log(f"{name}: {err}")
                return CompiledStep(name, time.perf_counter() - t0, None, {}, "not compiled", False, str(err))
            raise err from None
        seconds, mem, hlo = time.perf_counter() - t0, perf.step_memory(compiled), compiled.as_text()
        calls = dict(collections.Counter(_CUSTOM_CALL.findall(hlo)))
        machine_code = _machine_code(compiled, target.platform)
        step = CompiledStep(name, seconds, mem, calls, machine_code, True)
        step.roofline = step_roofline(compiled, hlo, target, model_flops, documents)
        if dump:
            chip = chip_named(target.kind)
            arch = chip.arch if chip is not None and chip.arch else "sm_90a"
            kernels = set(re.findall(r"/([\w$]+)/pallas_call", hlo))
            step.kernel_resources = [dataclasses.asdict(k) for k in kernel_resources(dump, kernels, arch)]
    finally:
        if dump:
            shutil.rmtree(dump, ignore_errors=True)
    try:
        where = f"{target.kind}'s usable memory ({target.hbm_source})"
        memory_precheck(mem, cfg.mesh, limit=target.hbm_bytes, what=f"the {name} step", source=where, knobs=knobs)
    except MemoryPrecheckError as e:
        step.fits, step.problem = False, str(e)
    log(f"{name}: compiled in {seconds:.1f} s")
    return step


def compile_for_target(
    cfg,
    target: Target,
    *,
    steps=STEPS,
    decode_batch: int = 0,
    prompt_len: int = 0,
    document_len: int = 0,
    log: Callable[[str], Any] = print,
) -> CompileReport:
    """Builds the run for `target` as train/setup.build does on that hardware and compiles `steps` there.
    `document_len` > 0 (a run with data.document_mask): the train and eval bounds and MFU ceilings counted on packed
    documents of that mean length (the kernels' skipped blocks, the model FLOPs of the pairs kept)."""
    check_packages(target.platform)
    unknown = set(steps) - set(STEPS)
    if unknown:
        raise CompileError(f"unknown step(s) {sorted(unknown)}; choose from {', '.join(STEPS)}")
    if document_len and not cfg.data.document_mask:
        raise CompileError(
            f"--documents={document_len} counts the document mask's skipped work, and this run attends across "
            "documents; add --config.data.document_mask=True (or leave --documents out)"
        )
    cfg = cfg.copy_and_resolve_references()
    cfg.mesh.device_memory_limit_gb = 0.0  # the target's memory is the limit, not this machine's
    with compiling_for(target.platform, target.kind):
        target_devices = target.devices()
        run = resolve(cfg, platform=target.platform, devices=len(target_devices), log=log)
        setup = build(run, devices=target_devices)
    cfg = run.cfg  # the run as it runs, typed
    documents = perf.packed_documents(cfg.data.seq_len, document_len) if document_len else None
    out = []
    programs = {  # step -> (program, its state, its batch's shape, a forward alone)
        "train": (setup.train_step, setup.abstract_state, setup.global_batch_shape, False),
        "eval": (setup.eval_step, setup.abstract_state.params, setup.eval_batch_shape, True),
    }
    for name, (program, state, shape, forward_only) in programs.items():
        if name in steps:
            batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=setup.batch_sh)
            flops = step_model_flops(cfg, shape[0], target.num_devices, forward_only, documents)
            step = compile_step(
                name, program, (state, batch), target, cfg, log=log, model_flops=flops, documents=documents
            )
            out.append(step)
    if "decode" in steps:
        out.extend(_compile_decode(setup, target, decode_batch, prompt_len, log))
    devices = cfg.mesh.num_devices or target.num_devices
    return CompileReport(
        target,
        setup.attention.impl,
        setup.cfg.model.dtype,
        dict(setup.mesh.shape),
        cfg.train.microbatch or cfg.train.global_batch,
        cfg.model.remat,
        out,
        perf.estimate_train_memory(cfg, devices) if "train" in steps else {},
        None
        if documents is None
        else {"mean_len": document_len, "attended_fraction": round(float(attended_fraction(documents, 1)), 4)},
        run_size(cfg),
    )


def step_model_flops(
    cfg, sequences: int, devices: int, forward_only: bool = False, documents=None
) -> tuple[float, float]:
    """(the model's own FLOPs, 6N FLOPs) per device for a step over `sequences` of data.seq_len tokens (perf.py's
    counts; a forward alone is a third of the training count); `documents`: attention by the pairs they keep."""
    f = perf.model_flops(cfg.model, cfg.data.seq_len)
    if documents is not None:
        f = f.attending(float(attended_fraction(documents, 1)))
    tokens = sequences * cfg.data.seq_len / devices
    scale = 1 / 3 if forward_only else 1.0
    return f.per_token * tokens * scale, f.per_token_6n * tokens * scale


DECODE_ROWS = 32  # --decode_batch's default: sequences one device decodes at once
DECODE_PAGE = 16  # tokens a cache page holds (the engine's default)


def _compile_decode(setup, target: Target, batch: int, prompt_len: int, log) -> list[CompiledStep]:
    """The decode engine's two programs (engine/runner.py `step_program`) on one device of the target, as a
    deployment runs an engine a device: a prefill chunk (the engine's 4 rows of up to 256 prompt tokens) and a
    decode step of `batch` rows (default 32), each attending over `prompt_len` tokens (default data.seq_len) of a
    paged cache sized for exactly those rows; the parameters unrolled, replicated. The decode step's roofline bound
    gives its tokens/s bound (`decode` in its JSON): rows over the bound, for one device. The weights are the
    engine's: in the compute dtype (engine.serving_params)."""
    from jax.sharding import Mesh

    from resformer_jax.engine.runner import serving_params, step_form, step_program, step_shapes
    from resformer_jax.engine.sampling import bucket
    from resformer_jax.model.attention import PageLayout
    from resformer_jax.model.transformer import Transformer, pool_shapes
    from resformer_jax.resolve import serving_model

    with compiling_for(target.platform, target.kind):
        m, form = serving_model(setup.model_cfg), step_form()
    rows = batch or DECODE_ROWS
    run_rows = bucket(rows, at_least=form.min_rows)  # the rows the engine runs them as, padding included
    context = min(prompt_len or setup.cfg.data.seq_len, m.max_seq_len - 1)
    pages_per_row = -(-(context + 1) // DECODE_PAGE)
    model = Transformer(m, pages=PageLayout(run_rows * pages_per_row + 1, DECODE_PAGE))
    one = NamedSharding(Mesh(target.devices()[:1], ("x",)), P())
    on_one = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), tree)
    params = on_one(jax.eval_shape(lambda p: serving_params(m, p, form.vocab_multiple), setup.abstract_state.params))
    with compiling_for(target.platform, target.kind):  # the pools laid out for the target's kernel
        cache = on_one(pool_shapes(model))
    program = jax.jit(step_program(model), donate_argnums=(1,), compiler_options=dict(form.compiler_options))
    out = []
    for name, (r, T) in (("decode_prefill", (4, min(256, context))), ("decode_token", (run_rows, 1))):
        step = compile_step(
            name, program, (params, cache, *on_one(step_shapes(model, r, T, pages_per_row))), target, setup.cfg, log=log
        )
        if name == "decode_token" and step.roofline:
            bound = step.roofline["per_op_bound_s"]
            step.decode = {
                "rows": rows,
                "rows_run": run_rows,  # with the padding rows a GPU's engine adds (StepForm.min_rows)
                "context_tokens": context,
                "kv_cache_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)),
                "bound_s": bound,
                "tokens_per_s_bound": rows / bound if bound else None,
                "devices": 1,
            }
        out.append(step)
    return out


@dataclasses.dataclass
class TuneResult:
    overrides: dict  # config field -> value
    memory_bytes: float | None
    fits: bool  # within the chip's memory with HEADROOM to spare
    bound_s: float | None  # the train step's per-op roofline bound
    mfu_ceiling: float | None  # model FLOPs
    problem: str = ""

    def flags(self) -> str:
        return " ".join(f"--config.{k}={v}" for k, v in self.overrides.items())


LONG_SEQUENCE = 16384  # --tune also tries the context axis (each sequence split over devices) from here on
TUNE_SKIP_FACTOR = 2.0  # --tune compiles no candidate whose --mode=summary estimate is over this x the memory
# A candidate must leave this share of the chip's memory free: the bound is not a timing, and a real run's
# allocator, NCCL buffers and fragmentation need room the compiled estimate does not show.
TUNE_HEADROOM = 0.10


def tune_candidates(cfg, devices: int) -> list[dict]:
    """The settings a user would try by hand: each remat policy, per-device microbatches halving from the whole
    batch to one sequence, the layers scanned or unrolled (a scan stacks what the backward keeps into [L, ...]
    buffers, a copy per saved tensor; unrolled layers keep them in place), (with several devices) the state
    sharded over all of them (fsdp) or replicated, and for long sequences each sequence split over 2, 4, ...
    devices (mesh.context)."""

    def microbatches(context: int) -> list[int]:  # a sequence's devices hold one sequence between them
        shards = devices // context
        per_device, out = max(1, cfg.train.global_batch // shards), []
        while per_device >= 1:
            out.append(per_device * shards)
            per_device //= 2
        return out

    meshes = [{"mesh.data": -1, "mesh.fsdp": 1}] + ([{"mesh.data": 1, "mesh.fsdp": -1}] if devices > 1 else [])
    meshes = [{**m, "mesh.context": 1} for m in meshes]
    T = cfg.data.seq_len
    if T >= LONG_SEQUENCE or cfg.mesh.context > 1:  # long sequences: split each over devices too
        for context in (2**i for i in range(1, devices.bit_length())):
            if devices % context == 0 and T % (2 * context) == 0:
                meshes.append({"mesh.data": -1, "mesh.fsdp": 1, "mesh.context": context})
    layouts = [False] if needs_unrolled(cfg.model) else [True, False]
    return [
        {"model.remat": r, "model.scan_layers": scan, "train.microbatch": mb, **mesh}
        for mesh in meshes
        for scan in layouts
        for r in REMAT_POLICIES
        for mb in microbatches(mesh["mesh.context"])
    ]


def tune(
    cfg,
    target: Target,
    log: Callable[[str], Any] = print,
    candidates: list[dict] | None = None,
) -> list[TuneResult]:
    """Compiles the train step for each candidate setting; per remat policy and mesh, microbatches are tried from
    the largest down until one fits, then one smaller (the step gets no faster below the largest that fits, and
    compiles cost time). Results that fit with headroom come first, by bound."""
    check_packages(target.platform)
    results: list[TuneResult] = []
    tried_fit: dict[tuple, int] = {}
    for cand in candidates or tune_candidates(cfg, target.num_devices):
        group = tuple((k, v) for k, v in cand.items() if k != "train.microbatch")
        if tried_fit.get(group, 0) >= 2:
            continue
        c = cfg.copy_and_resolve_references()
        for key, value in cand.items():
            set_dotted(c, key, value)
        est = perf.estimate_train_memory(RunConfig.of(c), target.num_devices).get("total", 0)
        if est > TUNE_SKIP_FACTOR * target.hbm_bytes:  # far over: compiling would only say so, slowly
            why = f"the estimate ({est / 2**30:.0f} GiB) is over {TUNE_SKIP_FACTOR:g}x the chip's memory; not compiled"
            results.append(TuneResult(cand, None, False, None, None, why))
            log(f"tune: {results[-1].flags()}: does not fit ({why})")
            continue
        try:
            report = compile_for_target(c, target, steps=("train",), log=lambda s: None)
        except UserError as e:
            results.append(TuneResult(cand, None, False, None, None, str(e)))
            continue
        step = report.steps[0]
        mem = step.memory.total if step.memory else None
        fits = step.fits and mem is not None and mem <= (1 - TUNE_HEADROOM) * target.hbm_bytes
        r = step.roofline or {}
        if r.get("unknown_trip_counts"):  # a loop counted once: its bound is not comparable with the others'
            r = {}
        problem = "" if fits else (step.problem or f"over {1 - TUNE_HEADROOM:.0%} of the chip's memory")
        res = TuneResult(cand, mem, fits, r.get("per_op_bound_s"), r.get("mfu_ceiling_model"), problem)
        results.append(res)
        if res.bound_s and res.fits:
            verdict = f"bound {res.bound_s * 1e3:.1f} ms, MFU ceiling {res.mfu_ceiling:.3f}"
        elif res.fits:
            verdict = "fits; bound unknown (a loop of the program has no known trip count), ranked last"
        else:
            verdict = f"does not fit ({res.problem[:120]})"
        log(f"tune: {res.flags()}: " + (f"{mem / 2**30:.1f} GiB, " if mem else "") + verdict)
        if fits:
            tried_fit[group] = tried_fit.get(group, 0) + 1
    return sorted(results, key=lambda r: (not r.fits, r.bound_s if r.bound_s is not None else float("inf")))
