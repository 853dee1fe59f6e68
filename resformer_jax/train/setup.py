"""One builder of the train state for every command: model, optimizer, shardings, jitted steps.

The trainer, the benchmark, generation, evaluation and analysis all come here:

  build(cfg)      -> TrainSetup: the mesh, `attention_impl=auto` resolved once by probing, the
                     model, the optimizer, the state's shardings and abstract shapes, and the
                     jitted train and eval steps (compiled on demand, with the memory precheck)
  load_run(dir)   -> a checkpoint's config and parameters, for inference and analysis
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from resformer_jax import kernels, perf, runtime
from resformer_jax.checkpoint import CheckpointError, failure_reason
from resformer_jax.config import validate, with_defaults
from resformer_jax.errors import UserError
from resformer_jax.kernels import cpu_matmul
from resformer_jax.kernels.names import backend_of
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig
from resformer_jax.parallel.mesh import batch_sharding, check_divisibility, logical_shardings, make_mesh, replicated
from resformer_jax.rundir import RunDir
from resformer_jax.train.optimizer import make_optimizer
from resformer_jax.train.step import TrainState, init_state, make_eval_step, make_train_step


class MemoryPrecheckError(UserError, RuntimeError):
    """The compiled step needs more memory per device than there is; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """The concrete attention impl a run uses, and why (what `auto` rejected)."""

    impl: str
    rejected: dict
    probed: bool  # True when `auto` was resolved by probing


def sequences_per_device(cfg, devices: int) -> int:
    """Sequences one device computes per microbatch (at least 1): the batch the probes and per-step choices see."""
    return max(1, (cfg.train.microbatch or cfg.train.global_batch) // max(1, devices))


def resolve_attention(
    cfg,
    *,
    override: str | None = None,
    batch: int | None = None,
    log: Callable[[str], Any] = print,
    platform: str | None = None,
) -> AttentionChoice:
    """`auto` -> the impl kernels.probe_auto picks at the run's shapes (per-device batch, seq_len, heads): on an
    accelerator the fastest forward and backward, on a CPU the first that runs. A named impl (or `override`, as bench
    and analyze pass) is kept as it is: if it cannot run, the first call raises, it never falls back.

    `platform` ('tpu', 'cuda'): the program is compiled for that hardware, not run here (compile/aot.py); `auto`
    is then that platform's own kernel (splash on TPU, this project's Pallas/Triton kernel on GPU), chosen
    without probing. On the hardware itself the probe times every candidate and keeps the fastest, which
    nothing here can know; whether the platform kernel compiles is what aot checks."""
    impl = override or cfg.model.attention_impl
    if impl != "auto":
        return AttentionChoice(impl, {}, False)
    if platform is not None:
        candidates, rejected = kernels.auto_candidates(backend_of(platform))
        choice = kernels.unprobed_auto(backend_of(platform))
        log(
            f"attention_impl=auto is {choice!r} on {platform} here (compiled, not probed: on the hardware "
            f"auto times {', '.join(candidates)} and keeps the fastest)"
        )
        return AttentionChoice(choice, rejected, False)
    m, mc = cfg.model, ModelConfig.of(cfg.model)
    if batch is None:
        batch = sequences_per_device(cfg, len(jax.devices()))
    choice, rejected = kernels.probe_auto(
        (batch, cfg.data.seq_len, m.num_heads, mc.head_dim), mc.kv_heads, jnp.dtype(m.dtype), log
    )
    return AttentionChoice(choice, rejected, True)


def resolve_dtype(cfg, log: Callable[[str], Any] = print, platform: str | None = None) -> str:
    """`model.dtype=auto` -> a concrete compute dtype (returned; `cfg` is not changed): bfloat16 on accelerators
    (also a compile target's `platform`); on CPU whichever multiplies the model's shapes faster here (measured,
    printed). A named dtype is kept."""
    platform = platform or jax.devices()[0].platform
    if cfg.model.dtype != "auto":
        if cfg.model.dtype == "bfloat16" and platform == "cpu" and not perf.cpu_has_bf16_matmul():
            log(
                "note: model.dtype=bfloat16 on a CPU without AVX-512 BF16 or AMX, where bf16 matmuls are usually "
                "slower than fp32; --config.model.dtype=auto measures both once and picks"
            )
        return cfg.model.dtype
    if platform != "cpu":
        choice, why = "bfloat16", f"{platform} computes in bf16 natively"
    else:
        choice, why = perf.faster_cpu_dtype(cfg.model, sequences_per_device(cfg, jax.device_count()) * cfg.data.seq_len)
    log(f"model.dtype=auto chose {choice}: {why}")
    return choice


def step_compiler_options(cfg, mesh, log: Callable[[str], Any] = print, platform: str | None = None) -> dict:
    """The XLA options the train and eval steps compile with, decided once per run (runtime.py says when and
    why there are any: on AVX2 CPUs without AVX-512, large steps' matmuls on Eigen); logged where there are."""
    rows = sequences_per_device(cfg, mesh.devices.size) * cfg.data.seq_len
    options, why = runtime.cpu_step_compiler_options(platform or jax.devices()[0].platform, rows)
    if options:
        log(f"train and eval steps: {why}")
    return options


def model_config(cfg, attention: AttentionChoice, platform: str | None = None) -> ModelConfig:
    """The typed model config the modules are built from: the run's, with the attention impl resolved and, for
    `matmuls=auto`, the platform's matmul forms (XLA:CPU's fast ones on a CPU, the plain ones elsewhere).
    (The run's own config, as saved in checkpoints, keeps what the user wrote, e.g. `auto`.)"""
    m = ModelConfig.of(cfg.model).replace(attention_impl=attention.impl)
    if m.matmuls == "auto":
        m = m.replace(matmuls=cpu_matmul.forms_for(platform or jax.devices()[0].platform))
    return m


def spike_window(t) -> int:
    """The loss-spike window the train state holds (0: spike skipping off, nothing in the state)."""
    return int(t.spike_window) if t.get("spike_sigma", 0.0) > 0 else 0


def state_template(model, tx, seq_len: int, spikes: int = 0):
    """The boxed (logically partitioned) train state as shapes, without allocating it."""
    return jax.eval_shape(lambda r: init_state(model, tx, r, seq_len, spikes), jax.random.PRNGKey(0))


@dataclasses.dataclass
class TrainSetup:
    cfg: Any  # the run's config as it runs: a copy of what was asked with model.dtype resolved
    model_cfg: ModelConfig  # cfg.model typed, with the attention impl and the matmul forms resolved
    attention: AttentionChoice
    mesh: jax.sharding.Mesh
    model: Transformer
    tx: Any
    state_sh: Any  # NamedShardings of the TrainState
    abstract_state: Any  # ShapeDtypeStructs with those shardings
    batch_sh: NamedSharding
    train_step: Any  # jitted (state, tokens [B, T+1]) -> (state, metrics)
    eval_step: Any  # jitted (params, tokens) -> loss
    compiler_options: dict  # XLA options both steps compile with (runtime.cpu_step_compiler_options; usually none)
    # train.telemetry: the same step with the per-layer norms in its metrics, run on logged steps only (a condition
    # inside one program kept every step's gradients and parameters live for it: 10% of an 82M CPU step)
    telemetry_step: Any = None

    @property
    def global_batch_shape(self) -> tuple[int, int]:
        return self.cfg.train.global_batch, self.cfg.data.seq_len + 1

    @property
    def eval_batch_shape(self) -> tuple[int, int]:
        """The evaluation batch: one microbatch (the whole batch without accumulation), so evaluating needs no
        more memory than a training microbatch."""
        return self.cfg.train.microbatch or self.cfg.train.global_batch, self.cfg.data.seq_len + 1

    def init_state(self, seed: int | None = None) -> TrainState:
        """A fresh state laid out on the mesh (parameters and optimizer state sharded)."""
        seed = self.cfg.train.seed if seed is None else seed
        spikes = spike_window(self.cfg.train)
        init = lambda r: nn.unbox(init_state(self.model, self.tx, r, self.cfg.data.seq_len, spikes))
        return jax.jit(init, out_shardings=self.state_sh)(jax.random.PRNGKey(seed))

    def compile(self, telemetry: bool = False):
        """(compiled train step, compile seconds, XLA's memory estimate per device); telemetry: the step with the
        per-layer norms (None when train.telemetry is off)."""
        step = self.telemetry_step if telemetry else self.train_step
        if step is None:
            return None, 0.0, None
        t0 = time.perf_counter()
        batch = jax.ShapeDtypeStruct(self.global_batch_shape, jnp.int32, sharding=self.batch_sh)
        compiled = step.lower(self.abstract_state, batch).compile()
        return compiled, time.perf_counter() - t0, perf.step_memory(compiled)


def build(
    cfg,
    *,
    mesh=None,
    attention: AttentionChoice | None = None,
    log: Callable[[str], Any] = print,
    devices=None,
    platform: str | None = None,
) -> TrainSetup:
    """Everything a command needs to train, benchmark or run the model described by `cfg`.

    `devices` and `platform`: build for other hardware than this machine's (compile/aot.py passes a TPU slice's or
    a GPU node's compile-only devices); everything else is what a run on that hardware builds."""
    validate(cfg)
    dtype = resolve_dtype(cfg, log=log, platform=platform)
    cfg = ml_collections.ConfigDict(cfg.to_dict())  # what the user asked stays as it was
    cfg.model.dtype = dtype
    mesh = mesh if mesh is not None else make_mesh(cfg.mesh, devices)
    check_divisibility(cfg, mesh)
    if attention is None:
        # the probe logs its choice and what it rejected, once
        attention = resolve_attention(cfg, log=log, platform=platform)
    model_cfg = model_config(cfg, attention, platform)
    model, tx = Transformer(model_cfg, mesh=mesh), make_optimizer(cfg.train)
    boxed = state_template(model, tx, cfg.data.seq_len, spike_window(cfg.train))
    state_sh = logical_shardings(boxed, mesh, cfg.mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.unbox(boxed), state_sh)
    batch_sh = batch_sharding(mesh)
    t = cfg.train
    num_micro = t.global_batch // (t.microbatch or t.global_batch)
    micro_sh = NamedSharding(mesh, P(None, ("data", "fsdp"), None))
    rep = replicated(mesh)
    options = step_compiler_options(cfg, mesh, log=log, platform=platform)

    def jitted_step(telemetry: bool):
        return jax.jit(
            make_train_step(
                model,
                tx,
                num_micro,
                micro_sh,
                t.loss_chunk_len,
                dropout_seed=t.seed,
                z_loss=t.z_loss,
                spike_sigma=t.spike_sigma,
                telemetry=telemetry,
            ),
            in_shardings=(state_sh, batch_sh),
            out_shardings=(state_sh, rep),
            donate_argnums=(0,),
            compiler_options=options or None,
        )

    train_step = jitted_step(False)
    eval_step = jax.jit(
        make_eval_step(model, t.loss_chunk_len),
        in_shardings=(state_sh.params, batch_sh),
        out_shardings=rep,
        compiler_options=options or None,
    )
    return TrainSetup(
        cfg,
        model_cfg,
        attention,
        mesh,
        model,
        tx,
        state_sh,
        abstract,
        batch_sh,
        train_step,
        eval_step,
        options,
        jitted_step(True) if t.telemetry else None,
    )


def memory_knobs(cfg, devices: int) -> str:
    """What lowers a train step's memory per device on `devices` devices, leaving out knobs already at their
    limit; the trainer's precheck and the compile command (compile/aot.py) say it."""
    knobs = []
    per_device = sequences_per_device(cfg, devices)
    if per_device > 1:
        knobs.append(
            f"lower config.train.microbatch (sequences per accumulation step: {per_device} a device now) "
            "or config.train.global_batch"
        )
    if cfg.model.remat != "full":
        knobs.append("use --config.model.remat=full")
    fsdp = perf.fsdp_devices(cfg, devices)
    if fsdp < devices:
        knobs.append(f"shard the state over more devices with config.mesh.fsdp (now {fsdp} of {devices})")
    if not knobs:
        return (
            f"it does not fit even with one sequence a device, remat=full and the state sharded over all "
            f"{devices} devices: use more devices, or a shorter config.data.seq_len or a smaller model"
        )
    return ", ".join(knobs[:-1]) + (" or " if len(knobs) > 1 else "") + knobs[-1]


def device_memory_limit(mesh_cfg) -> tuple[float | None, str]:
    """(bytes one device may use, where that number comes from) for this machine's first device."""
    if mesh_cfg.device_memory_limit_gb > 0:
        return mesh_cfg.device_memory_limit_gb * 2**30, "config.mesh.device_memory_limit_gb"
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"], "the device's memory"
    if device.platform == "cpu":
        # XLA:CPU reports no limit: the host's RAM shared by its CPU devices (an allocation beyond it fails
        # deep inside the runtime, after the step has started)
        return (
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, jax.local_device_count()),
            "this host's memory per CPU device",
        )
    return None, ""


def too_big_for_here(cfg, devices: int) -> str | None:
    """Why the train step cannot fit this machine's `devices` devices by the analytic estimate
    (perf.estimate_train_memory, with a flash kernel: the lower bound), or None. Said before the attention probe and
    the compile, with what the config is sized for and what would fit here; a step the estimate lets through still
    meets the compiled step's precheck."""
    limit, source = device_memory_limit(cfg.mesh)
    if cfg.model.dtype == "auto":  # resolved later (build); bf16, the smaller choice, keeps this a lower bound
        cfg = ml_collections.ConfigDict(cfg.to_dict())
        cfg.model.dtype = "bfloat16"
    est = perf.estimate_train_memory(cfg, devices)
    if not limit or est["total"] <= limit:
        return None
    gib = lambda b: f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"
    t = cfg.train
    target = re.match(r"\s*(\d+)\s*x\s*(H100|H200|A100)", cfg.mesh.target or "", re.I)
    check = (
        f"check it for that hardware with resformer compile --config=(the same file) "
        f"--target={target.group(2).lower()}x{target.group(1)}"
        if target
        else ""
    )
    fits = None
    fsdp_now = perf.fsdp_devices(cfg, devices)
    for remat, fsdp in dict.fromkeys(((cfg.model.remat, fsdp_now), ("full", fsdp_now), ("full", devices))):
        per_device = sequences_per_device(cfg, devices)
        while per_device >= 1 and fits is None:
            trial = ml_collections.ConfigDict(cfg.to_dict())
            trial.model.remat, trial.train.microbatch, trial.mesh.fsdp = remat, per_device * devices, fsdp
            if (
                t.global_batch % trial.train.microbatch == 0
                and perf.estimate_train_memory(trial, devices)["total"] <= limit
            ):
                fits = (
                    f"--config.train.microbatch={trial.train.microbatch}"
                    + (f" --config.model.remat={remat}" if remat != cfg.model.remat else "")
                    + (f" --config.mesh.fsdp={fsdp} --config.mesh.data=1" if fsdp != fsdp_now else "")
                )
            per_device //= 2
    here = (
        f"to run it here, {fits} fits by the estimate (or lower config.train.global_batch)"
        if fits
        else memory_knobs(cfg, devices) + f" (parameters and optimizer state alone: {gib(est['state'])} a device)"
    )
    sized = (f"this config is sized for {cfg.mesh.target}" + (f": {check}" if check else "")) if cfg.mesh.target else ""
    return (
        f"the train step needs about {gib(est['total'])} per device by the analytic estimate (state "
        f"{gib(est['state'])}, activations {gib(est['activations_kept'] + est['one_layer'])}, attention "
        f"{gib(est['attention'])}, logits {gib(est['logits'])}, "
        f"{est['per_device_micro_batch']} sequences of {cfg.data.seq_len} tokens a device at once) but {source} "
        f"is {gib(limit)}; " + "; ".join(x for x in (sized, here) if x)
    )


def memory_line(mem: perf.StepMemory, limit: float | None) -> str:
    gib = lambda b: f"{b / 2**30:.3f} GiB"
    return (
        f"per-device memory: arguments {gib(mem.arguments)}, outputs {gib(mem.outputs)}, aliased "
        f"{gib(mem.aliased)}, temporaries {gib(mem.temporaries)}, total {gib(mem.total)}"
        + (f" of {gib(limit)}" if limit else "")
    )


def memory_precheck(
    mem: perf.StepMemory | None,
    mesh_cfg,
    *,
    limit: float | None = None,
    source: str = "",
    what: str = "the train step",
    knobs: str = "",
) -> tuple[str, float | None]:
    """(a line describing the step's memory per device, the limit); raises where it cannot fit, naming `knobs`
    (memory_knobs' advice).
    `limit`/`source`: another device's memory (a compile target's); default: this machine's first device."""
    if mem is None:
        return "per-device memory: not reported by this backend", None
    if limit is None:
        limit, source = device_memory_limit(mesh_cfg)
    if limit and mem.total > limit:
        raise MemoryPrecheckError(
            f"{what} needs {mem.total / 2**30:.3f} GiB per device but {source} is {limit / 2**30:.3f} GiB "
            f"(arguments {mem.arguments / 2**30:.3f} GiB, temporaries {mem.temporaries / 2**30:.3f} GiB)"
            + (f"; {knobs}" if knobs else "")
        )
    return memory_line(mem, limit), limit


@contextlib.contextmanager
def _library_reports_held():
    """While a reader tries a checkpoint: Orbax's own error logs and its threads' tracebacks are held back (a
    damaged checkpoint's failure is said in one line by load_run; a reader writes nothing into the run)."""

    loggers = [logging.getLogger(name) for name in ("absl", "orbax")]
    levels = [lg.level for lg in loggers]
    hook = threading.excepthook
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    threading.excepthook = lambda args: None
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        threading.excepthook = hook


class LoadedRun(NamedTuple):
    cfg: ml_collections.ConfigDict  # the run's config, attention_impl resolved for this machine
    params: Any
    step: int


def load_run(
    workdir: str,
    step: int | None = None,
    *,
    attention_impl: str | None = None,
    log: Callable[[str], Any] = lambda s: None,
    warn: Callable[[str], Any] = lambda s: print(s, file=sys.stderr, flush=True),
) -> LoadedRun:
    """A run's checkpoint (newest that restores, or `step`) on the default device, for inference and analysis.
    `attention_impl` overrides the run's impl (analyze uses `reference`); `auto` is probed here.

    Reads only: a damaged newest checkpoint is named through `warn` and the newest one that restores is used (as
    training does), but nothing is moved, since another process may be training in the run."""
    run = RunDir(workdir)
    if not run.checkpoints.is_dir():
        what = "has no checkpoints/ folder" if run.path.is_dir() else "does not exist"
        raise CheckpointError(
            f"run directory {workdir} {what}; check --workdir (train first with "
            f"python -m resformer_jax.main --workdir={workdir})"
        )
    ck = run.checkpointer(read_only=True)
    try:
        steps = ck.all_steps()
        if not steps:
            raise CheckpointError(
                f"no checkpoint in {ck.dir}; train first (python -m resformer_jax.main --workdir={workdir})"
            )
        if step is not None and step not in steps:
            raise CheckpointError(f"no checkpoint at step {step} in {ck.dir}; available: {steps}")
        failures = []
        for candidate in [step] if step is not None else list(reversed(steps)):
            try:
                cfg = ml_collections.ConfigDict(with_defaults(ck.read_config(candidate)))
                model = Transformer(cfg.model)
                dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                boxed = state_template(model, make_optimizer(cfg.train), cfg.data.seq_len, spike_window(cfg.train))
                abstract = jax.tree.map(
                    lambda x, dev=dev: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), nn.unbox(boxed)
                )
                with _library_reports_held():
                    state, _, _ = ck.restore(candidate, abstract)
            except Exception as e:
                failures.append((candidate, failure_reason(e)[:300]))
                continue
            if failures:
                warn(
                    f"WARNING: checkpoint at step {failures[0][0]} ({ck.dir}/{failures[0][0]}) does not restore "
                    f"({failures[0][1]}); using step {candidate}, the newest that restores (pass --step={candidate}"
                    " to choose it; nothing in the run was moved)"
                )
            step = candidate
            break
        else:
            if len(failures) == 1 and len(steps) > 1:
                others = [s for s in steps if s != failures[0][0]]
                raise CheckpointError(
                    f"the checkpoint at step {failures[0][0]} in {ck.dir} does not restore "
                    f"({failures[0][1]}); pass another --step (available: {others})"
                )
            raise CheckpointError(
                f"none of the checkpoints in {ck.dir} restores ({failures}); retrain, or "
                "restore the run directory from a copy"
            )
    finally:
        ck.mngr.close()
    choice = resolve_attention(cfg, override=attention_impl, batch=1, log=log)
    # readers build the model from cfg.model: the attention impl and matmul forms resolved for this machine
    cfg.model = ml_collections.ConfigDict(model_config(cfg, choice).to_dict())
    return LoadedRun(cfg, state.params, step)
