"""What the user asked, resolved once into the run as it runs: one frozen `Run` that the builder, the trainer's
session, the summary, the compile command and the benchmarks take. Every `auto` model field (attention_impl,
norm_impl, matmuls, dtype) is decided here alone: the model refuses one that is not.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from resformer_jax import perf, runtime
from resformer_jax.checkpoint import CheckpointError
from resformer_jax.config import (
    ConfigError,
    RunConfig,
    parse_init_from,
    run_record,
    set_dotted,
    validate,
    with_defaults,
)
from resformer_jax.kernels import names, probe
from resformer_jax.kernels.names import backend_of, target_backend
from resformer_jax.model.attention import kernel_can_mix_values
from resformer_jax.model.config import ModelConfig
from resformer_jax.rundir import RunDir


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """The concrete attention impl a run uses, and why (what `auto` rejected)."""

    impl: str
    rejected: dict
    probed: bool  # True when `auto` was resolved by probing


@dataclasses.dataclass(frozen=True)
class Run:
    """A run as it runs. `asked`: the config as the user gave it (never changed); `cfg`: the same, typed, with the
    resolved values in place, its model (`model`) the one the modules are built from: attention impl, matmul
    forms and norm resolved for the platform; `compiler_options`: the XLA options its steps compile with (usually
    none)."""

    asked: ml_collections.FrozenConfigDict
    cfg: RunConfig
    attention: AttentionChoice
    compiler_options: tuple[tuple[str, Any], ...]
    platform: str
    why: dict = dataclasses.field(default_factory=dict)  # {resolved field: how `auto` decided it (its numbers)}

    @property
    def model(self) -> ModelConfig:
        """The typed model the modules are built from: cfg.model, its `auto` fields resolved."""
        return self.cfg.model

    def record(self) -> dict:
        """What a run saves: the config as asked, the values resolved at start (config.RESOLVED_FIELDS) and how
        each `auto` among them was decided."""
        return {**run_record(self.asked.to_dict(), self.cfg), "resolved_why": dict(self.why)}


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
    """`auto` -> the impl kernels/probe.py `probe_auto` picks at the run's shapes (per-device batch, seq_len, heads):
    on an accelerator the fastest forward and backward, on a CPU the first that runs. A named impl (or `override`,
    as bench and analyze pass) is kept as it is: if it cannot run, the first call raises, it never falls back.

    `platform` ('tpu', 'cuda'): the program is compiled for that hardware, not run here (compilation/aot.py); `auto`
    is then that platform's own kernel (splash on TPU, this project's Pallas/Triton kernel on GPU), chosen
    without probing. On the hardware itself the probe times every candidate and keeps the fastest, which
    nothing here can know; whether the platform kernel compiles is what aot checks."""
    impl = override or cfg.model.attention_impl
    if impl != "auto":
        return AttentionChoice(impl, {}, False)
    context = cfg.mesh.context
    if context > 1:  # a GPU's or TPU's own kernel on each device's slices, XLA's attention elsewhere
        backend = backend_of(platform) if platform is not None else jax.default_backend()
        choice = {"gpu": "pallas", "tpu": "splash"}.get(backend, "xla")
        rejected = {
            i: "it does not run context-parallel yet" for i in names.IMPLS if i not in names.CONTEXT_PARALLEL_IMPLS
        }
        log(f"attention_impl=auto is {choice!r} with mesh.context={context} (keys and values gathered over the axis)")
        return AttentionChoice(choice, rejected, False)
    if platform is not None:
        candidates, rejected = names.auto_candidates(backend_of(platform))
        choice = names.unprobed_auto(backend_of(platform))
        log(
            f"attention_impl=auto is {choice!r} on {platform} here (compiled, not probed: on the hardware "
            f"auto times {', '.join(candidates)} and keeps the fastest)"
        )
        return AttentionChoice(choice, rejected, False)
    m, mc = cfg.model, ModelConfig.of(cfg.model)
    if batch is None:
        batch = sequences_per_device(cfg, len(jax.devices()))
    choice, rejected = probe.probe_auto(
        (batch, cfg.data.seq_len, m.num_heads, mc.head_dim),
        mc.kv_heads,
        jnp.dtype(m.dtype),
        log,
        documents=bool(cfg.data.document_mask),
        value_mix=kernel_can_mix_values(mc),
    )
    return AttentionChoice(choice, rejected, True)


def resolve_dtype(cfg, log: Callable[[str], Any] = print, platform: str | None = None) -> tuple[str, str]:
    """`model.dtype=auto` -> (a concrete compute dtype, why); `cfg` is not changed: bfloat16 on accelerators (also a
    compile target's `platform`); on a CPU float32 unless it has bf16 matmul instructions and multiplies the
    model's shapes clearly faster in bf16 (perf.faster_cpu_dtype, printed). A named dtype is kept."""
    platform = platform or jax.devices()[0].platform
    if cfg.model.dtype != "auto":
        if cfg.model.dtype == "bfloat16" and platform == "cpu" and not perf.cpu_has_bf16_matmul():
            log(
                "note: model.dtype=bfloat16 on a CPU without AVX-512 BF16 or AMX, where bf16 matmuls are usually "
                "slower than fp32; --config.model.dtype=auto chooses float32 there"
            )
        return cfg.model.dtype, "named in the config"
    if platform != "cpu":
        choice, why = "bfloat16", f"{platform} computes in bf16 natively"
    else:
        choice, why = perf.faster_cpu_dtype(
            ModelConfig.of(cfg.model), sequences_per_device(cfg, jax.device_count()) * cfg.data.seq_len
        )
    log(f"model.dtype=auto chose {choice}: {why}")
    return choice, why


def model_config(
    cfg, attention: AttentionChoice, platform: str | None = None, probe_rows: int = 0, log: Callable[[str], Any] = print
) -> ModelConfig:
    """The typed model config the modules are built from: the run's, with the attention impl resolved and, for
    `norm_impl=auto` on a GPU where the Pallas kernels apply, the faster of them and XLA's at `probe_rows` tokens
    (kernels/probe.py probe_norm); the other `auto` fields as `for_backend` gives them for the platform. (The run's
    own config, as saved in checkpoints, keeps what the user wrote, e.g. `auto`.)"""
    m = ModelConfig.of(cfg.model).replace(attention_impl=attention.impl)
    backend = backend_of(platform or jax.devices()[0].platform)
    if m.norm_impl == "auto" and probe_rows and backend == "gpu" and m.norm_kernel_applies:
        m = m.replace(norm_impl=probe.probe_norm(probe_rows, m.d_model, jnp.dtype(m.dtype), log))
    return for_backend(m, backend)


def for_backend(m: ModelConfig, backend: str | None = None) -> ModelConfig:
    """`m` with each `auto` field given its unprobed choice for `backend` ('cpu', 'gpu', 'tpu'; default: the one
    traced for, kernels.names.target_backend); named fields kept. attention: the backend's first candidate
    (names.unprobed_auto); matmuls: XLA:CPU's fast forms on a CPU ("cpu", kernels/cpu_matmul.py), the plain ones
    elsewhere; norm: the Pallas kernels on a GPU where they apply (Triton), XLA's elsewhere; dtype: bfloat16 on an
    accelerator, float32 on a CPU (a run's start times the two instead: resolve_dtype)."""
    backend = backend or target_backend()
    fields: dict[str, str] = {}
    if m.attention_impl == "auto":
        fields["attention_impl"] = names.unprobed_auto(backend)
    if m.matmuls == "auto":
        fields["matmuls"] = "cpu" if backend == "cpu" else "plain"
    if m.norm_impl == "auto":
        fields["norm_impl"] = "pallas" if backend == "gpu" and m.norm_kernel_applies else "xla"
    if m.dtype == "auto":
        fields["dtype"] = "float32" if backend == "cpu" else "bfloat16"
    return m.replace(**fields) if fields else m


def serving_model(m: ModelConfig) -> ModelConfig:
    """The model as the decode engine runs it, for the backend it is traced for: `for_backend`'s, layers unrolled
    (a paged cache a layer: no stacked copies), no remat, and on a CPU with a bf16 or fp16 model the "rounded"
    matmuls (cpu_matmul.rounded_matmul: the same rounded operands, fp32 arithmetic; XLA:CPU's bf16 matrix-vector
    products are slower than fp32's, docs/evaluation.md)."""
    m = for_backend(m)
    narrow = m.dtype in ("bfloat16", "float16")
    matmuls = "rounded" if narrow and target_backend() == "cpu" else m.matmuls
    return m.replace(scan_layers=False, remat="none", matmuls=matmuls)


def fork_point(cfg, run: RunDir | None, log: Callable[[str], Any] = print) -> str:
    """train.init_from as RUN:STEP: RUN alone is its newest finished checkpoint; a resumed fork keeps the step its
    start resolved (config.json's record)."""
    value = cfg.train.init_from
    if not value or parse_init_from(value)[1] is not None:
        return value
    if run is not None and run.config_json.is_file() and run.checkpoints.is_dir() and any(run.checkpoints.iterdir()):
        return with_defaults(run.read_config())["train"]["init_from"]
    source_name = parse_init_from(value)[0]
    source = RunDir(source_name)
    steps = source.finished_steps() if source.checkpoints.is_dir() else []
    if not steps:
        raise CheckpointError(f"train.init_from: run directory {source_name} has no checkpoints; check the path")
    log(f"train.init_from={source_name}: forking from its newest checkpoint, step {steps[-1]}")
    return f"{source_name}:{steps[-1]}"


def recorded_dtype(run: RunDir | None, log: Callable[[str], Any] = print) -> str | None:
    """The dtype a resumed run's start chose for model.dtype=auto (config.json's record): decided once per run,
    never measured again (a busy host could choose otherwise). None for a new run."""
    if run is None or not run.finished_steps() or not run.config_json.is_file():
        return None
    try:
        chosen = run.read_config().get("resolved", {}).get("model.dtype")
    except (OSError, ValueError):
        return None
    if chosen in (None, "auto"):
        return None
    log(f"model.dtype=auto: {chosen}, as chosen at the run's start (its config.json)")
    return chosen


def check(asked) -> RunConfig:
    """Every field that could make a run impossible (config.validate), the config typed: the one place it is
    called, for a run (once a start) and for a command that only inspects a config (the summary, a sweep's
    points)."""
    return validate(asked)


def resolve(
    asked,
    *,
    run: RunDir | None = None,
    tokenizer_hash: str | None = None,
    eot_id: int | None = None,
    attention: AttentionChoice | str | None = None,
    platform: str | None = None,
    devices: int | None = None,
    log: Callable[[str], Any] = print,
    typed: RunConfig | None = None,
) -> Run:
    """The run `asked` describes, resolved once (docs/modules.md). `run`: its directory, whose record a
    resumed run keeps (the fork's step, the dtype); `attention`: a choice made already, or an impl to use instead
    of the config's (bench, analyze); `platform`/`devices`: compiling for other hardware (compilation/aot.py)."""
    typed = typed if typed is not None else check(asked)  # `typed`: the start typed it already (its one check)
    cfg = ml_collections.ConfigDict(asked.to_dict())
    cfg.train.init_from = fork_point(cfg, run, log)
    if cfg.train.init_from and cfg.train.schedule == "wsd" and not cfg.train.decay_start_step:
        cfg.train.decay_start_step = parse_init_from(cfg.train.init_from)[1]  # a fork of a WSD run: its cooldown
    dtype_why = ""
    if cfg.model.dtype == "auto":
        recorded = recorded_dtype(run, log)
        cfg.model.dtype, dtype_why = (recorded, "as chosen at the run's start") if recorded else ("auto", "")
    if cfg.model.dtype == "auto":
        cfg.model.dtype, dtype_why = resolve_dtype(cfg, log=log, platform=platform)
    if tokenizer_hash is not None:
        set_dotted(cfg, "data.tokenizer_hash", tokenizer_hash)
    if cfg.data.document_mask:  # the token documents end with: set, or the corpus's
        eot = int(cfg.data.eot_id) if cfg.data.eot_id >= 0 else eot_id
        if eot is None or eot < 0:
            raise ConfigError(
                "config.data.document_mask: the corpus's metadata.json names no end-of-text token (eot_id). "
                "Fix: set --config.data.eot_id to the token that ends each document."
            )
        cfg.model.document_eot = eot
    if not isinstance(attention, AttentionChoice):
        attention = resolve_attention(cfg, override=attention, log=log, platform=platform)
    here = platform is None  # run on this machine's devices (the norm can be timed), not compiled for others
    platform = platform or jax.devices()[0].platform
    n = devices or cfg.mesh.num_devices or jax.device_count()
    rows = sequences_per_device(cfg, n) * cfg.data.seq_len
    options, why = runtime.cpu_step_compiler_options(platform, rows)
    if options:
        log(f"train and eval steps: {why}")
    resolved = typed.with_resolved(
        model=model_config(cfg, attention, platform, probe_rows=rows if here else 0, log=log),
        data=dataclasses.replace(typed.data, tokenizer_hash=cfg.data.tokenizer_hash),
        train=dataclasses.replace(
            typed.train, init_from=cfg.train.init_from, decay_start_step=cfg.train.decay_start_step
        ),
    )
    return Run(
        asked=ml_collections.FrozenConfigDict(asked),
        cfg=resolved,
        attention=attention,
        compiler_options=tuple(sorted(options.items())),
        platform=platform,
        why={"model.dtype": dtype_why} if dtype_why else {},
    )
