"""Config schema: the typed sections, their defaults, validation with clear errors (the presets: presets.py).

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import types

import ml_collections

from resformer_jax.errors import ConfigError
from resformer_jax.kernels.names import CONTEXT_PARALLEL_IMPLS
from resformer_jax.model.config import (
    REMAT_POLICIES,
    RESFORMER_LAMBDAS,
    VALUE_RESIDUAL_MODES,
    ModelConfig,
    check_kinds,
)

__all__ = ["REMAT_POLICIES", "RESFORMER_LAMBDAS", "VALUE_RESIDUAL_MODES", "ConfigError"]

DATA_SOURCES = ("synthetic", "array_record", "tfds", "demo")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
LOSS_CHUNK_LEN = 128  # LM head + cross entropy fused over this many positions at a time (train/loss.py); 0: full logits


# Paper Table 2 domain proportions (SlimPajama 20B sample).
PAPER_MIXTURE = {
    "RedPajamaCommonCrawl": 0.5,
    "RedPajamaC4": 0.2,
    "RedPajamaGithub": 0.1,
    "RedPajamaBook": 0.05,
    "RedPajamaArXiv": 0.05,
    "RedPajamaWikipedia": 0.05,
    "RedPajamaStackExchange": 0.05,
}


def base_config() -> ml_collections.ConfigDict:
    """Every field with its default, as the command line edits it (`--config.train.steps=...`): the typed sections'
    defaults (ModelConfig in model/config.py, the others below), one ConfigDict section each."""
    return ml_collections.ConfigDict(RunConfig().to_dict())


_NO_DEFAULT = object()


class MissingField(KeyError):
    """A dotted path with a part that is not there: `parent` (the node that exists, "" for the root) lacks `part`;
    `fields` are the parent's fields."""

    def __init__(self, dotted: str, parent: str, part: str, fields: list[str]):
        super().__init__(dotted)
        self.dotted, self.parent, self.part, self.fields = dotted, parent, part, fields


def get_dotted(tree, dotted: str, default=_NO_DEFAULT):
    """tree["a"]["b"] for "a.b" (a ConfigDict, nested dicts or the typed RunConfig); MissingField (a KeyError)
    where a part is missing, unless a default is given. The one walker of dotted config paths."""
    node, parts = tree, dotted.split(".")
    for i, part in enumerate(parts):
        fields = (
            [f.name for f in dataclasses.fields(node)]
            if dataclasses.is_dataclass(node)
            else list(getattr(node, "keys", list)())
        )
        if part not in fields:
            if default is _NO_DEFAULT:
                raise MissingField(dotted, ".".join(parts[:i]), part, fields)
            return default
        node = getattr(node, part) if dataclasses.is_dataclass(node) else node[part]
    return node


def set_dotted(tree, dotted: str, value) -> None:
    """tree["a"]["b"] = value for "a.b" (the parents must exist: KeyError otherwise)."""
    *parents, last = dotted.split(".")
    node = get_dotted(tree, ".".join(parents)) if parents else tree
    node[last] = value


# What a run resolves at start and records beside what was asked (the checkpoint's config and config.json hold
# the asked config plus {"resolved": {field: value}}): the compute dtype `auto` chose, the corpus's tokenizer.
# init_from: RUN -> RUN:STEP; document_eot: data.document_mask's end-of-text token, from the corpus
RESOLVED_FIELDS = ("model.dtype", "data.tokenizer_hash", "train.init_from", "model.document_eot")


def run_record(asked: dict, resolved_cfg) -> dict:
    """What a run saves: the config as the user asked it, and the values resolved at start (RESOLVED_FIELDS)."""
    return {**asked, "resolved": {field: get_dotted(resolved_cfg, field) for field in RESOLVED_FIELDS}}


def as_run(saved: dict) -> dict:
    """A saved config as the run ran it: the resolved values in place of what was asked (runs saved before the
    record had both hold the resolved values in place already)."""
    if not isinstance(saved, dict) or "resolved" not in saved:
        return saved
    kept = {k: v for k, v in saved.items() if k not in ("resolved", "resolved_why")}
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in kept.items()}
    for field, value in saved["resolved"].items():
        section, name = field.split(".", 1)
        out.setdefault(section, {})[name] = value
    return out


def with_defaults(saved: dict) -> dict:
    """A saved config dict as the run ran it (`as_run`), with the fields added since it was saved filled in from
    base_config(). A GPT-2 run saved before `tie_embeddings` existed was tied (its checkpoints hold no lm_head)."""
    saved = as_run(saved)
    model = saved.get("model", {}) if isinstance(saved, dict) else {}
    if isinstance(model, dict):
        saved = {**saved, "model": ModelConfig.upgrade(model)}

    def merge(base, over):
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
        return out

    return merge(base_config().to_dict(), saved)


def parse_mixture(value) -> dict[str, float]:
    """config.data.mixture as {domain: weight}: from "RedPajamaC4=0.3,RedPajamaGithub=0.1" (what the command
    line sets) or a dict (configs written before it was a string)."""
    if not value:
        return {}
    if not isinstance(value, str):
        return {str(k): float(v) for k, v in dict(value).items()}
    out = {}
    for item in value.split(","):
        dom, eq, w = item.strip().partition("=")
        try:
            out[dom.strip()] = float(w)
        except ValueError:
            _fail(
                "data.mixture",
                f"{item.strip()!r} is not DOMAIN=WEIGHT",
                "write e.g. --config.data.mixture=RedPajamaC4=0.3,RedPajamaGithub=0.1",
            )
        if not eq or not dom.strip() or out[dom.strip()] < 0:
            _fail(
                "data.mixture",
                f"{item.strip()!r} is not DOMAIN=WEIGHT with a weight >= 0",
                "write e.g. --config.data.mixture=RedPajamaC4=0.3,RedPajamaGithub=0.1",
            )
    if sum(out.values()) <= 0:
        _fail("data.mixture", "all weights are 0", "give at least one domain a positive weight")
    return out


def parse_init_from(value: str) -> tuple[str, int | None]:
    """train.init_from's RUN:STEP as (run, step); step None where the text after the last ':' is no step (RUN alone:
    its newest checkpoint, resolved at the fork's start)."""
    run, sep, step = value.rpartition(":")
    return (run, int(step)) if sep and step.isdigit() else (value, None)


def _fail(field: str, problem: str, fix: str):
    raise ConfigError(f"config.{field}: {problem}. Fix: {fix}.")


def _positive_steps(field: str, every: int) -> None:
    if every <= 0:  # each also happens at the last step: N = train.steps means only there
        _fail(field, f"must be a positive number of steps, got {every}", "set N >= 1 (train.steps: only at the end)")


# The run's config sections, typed and frozen: each field with its default and what it means, and each section's
# __post_init__ checking its own fields (`RunConfig` checks the fields that depend on two sections). The
# ConfigDict the command line edits is built from these defaults (base_config); `RunConfig.of` turns it back.


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"  # synthetic | array_record | tfds | demo
    path: str = ""
    seq_len: int = 2048
    mixture: str = ""  # "DOMAIN=WEIGHT,DOMAIN=WEIGHT" (renormalised); empty: the paper's Table 2 mixture.
    seed: int = 0
    num_threads: int = 2
    prefetch: int = 4
    tokenizer_hash: str = ""  # filled at start from metadata.json, checked on resume.
    # Packed documents: attention within each document only, positions restarting at each (model.document_eot,
    # resolved at start from the corpus's end-of-text token). Off: every token attends to every earlier one of its
    # sequence, across documents, as the paper trains.
    document_mask: bool = False
    eot_id: int = -1  # the end-of-text token when the data does not say (synthetic data); -1: the corpus's own
    # With document_mask: whether the loss counts the target after an end-of-text token (a document's first token,
    # predicted from the end of the one before); False leaves it out, as a run of each document alone would.
    document_start_loss: bool = True

    def __post_init__(self):
        if self.seq_len < 1:
            _fail("data.seq_len", f"must be positive, got {self.seq_len}", "set data.seq_len >= 1")
        parse_mixture(self.mixture)
        if self.source not in DATA_SOURCES:
            _fail("data.source", f"unknown source {self.source!r}", f"use {', '.join(DATA_SOURCES)}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    global_batch: int = 1024  # sequences per optimizer step
    microbatch: int = 0  # sequences per microbatch (0: no accumulation)
    steps: int = 10000
    peak_lr: float = 6e-4
    init_lr: float = 1e-7
    final_lr_ratio: float = 0.1
    warmup_steps: int = 120
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 500
    eval_batches: int = 4
    skip_nonfinite_steps: bool = False
    loss_chunk_len: int = LOSS_CHUNK_LEN
    stop_at: int = 0  # >0: save and exit after this step (for time-limited jobs); the schedule still spans `steps`
    # adamw (the paper) | muon: Muon on the hidden weight matrices (each layer's own, orthogonalised by
    # Newton-Schulz), AdamW with peak_lr on embeddings, LM head, norms, biases and the value-residual scalars.
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    # cosine (the paper: warmup_steps, then cosine to final_lr_ratio) | wsd (warmup, stable, decay: fractions of
    # `steps` summing to 1, the decay in wsd_decay_shape) | constant (warmup_steps, then peak_lr)
    schedule: str = "cosine"
    wsd_fractions: tuple[float, ...] = (0.01, 0.79, 0.2)
    wsd_decay_shape: str = "1-sqrt"  # linear | cosine | 1-sqrt
    decay_start_step: int = 0  # >0: the WSD decay starts here (a cooldown forked with init_from sets it)
    # RUN:STEP (or RUN, its newest step): start this new run from that run's checkpoint (parameters, optimizer
    # state, the data's position) with the WSD decay starting there: a cooldown forked from a stable run.
    init_from: str = ""
    z_loss: float = 0.0  # PaLM's z-loss: z_loss * mean(log Z^2) of the logits' log-normaliser, added to the loss
    # Loss-spike skipping: a step whose loss or gradient norm is more than spike_sigma standard deviations above
    # the mean of the last spike_window applied steps is not applied (0: off; non-finite steps: skip_nonfinite).
    spike_sigma: float = 0.0
    spike_window: int = 100
    # Per-layer telemetry at each log: gradient, parameter and update norms per layer and kind (attention, MLP,
    # norms, scalars; embeddings and LM head), to TensorBoard as telemetry/{what}/{kind}/layer_NN.
    telemetry: bool = False
    # Weights & Biases (pip install -e '.[wandb]'): every scalar also to this project, from process 0; the run id is
    # kept in the run directory, so a resumed run appends to the same W&B run. WANDB_MODE=offline needs no network.
    wandb_project: str = ""

    def __post_init__(self):
        if self.global_batch <= 0:
            _fail("train.global_batch", f"must be positive, got {self.global_batch}", "set a positive batch")
        if self.microbatch and self.global_batch % self.microbatch:
            _fail(
                "train.microbatch",
                f"{self.microbatch} does not divide global_batch={self.global_batch}",
                "choose a microbatch dividing the global batch",
            )
        if self.steps <= 0:
            _fail("train.steps", f"must be positive, got {self.steps}", "set train.steps >= 1")
        _positive_steps("train.log_every", self.log_every)
        _positive_steps("train.eval_every", self.eval_every)
        if self.loss_chunk_len < 0:
            _fail(
                "train.loss_chunk_len",
                f"must be >= 0, got {self.loss_chunk_len}",
                "set a positive block length (e.g. 128), or 0 for full logits",
            )
        if self.warmup_steps < 0 or self.warmup_steps >= self.steps:
            _fail(
                "train.warmup_steps",
                f"{self.warmup_steps} not in [0, train.steps={self.steps})",
                "use fewer warmup steps than total steps",
            )
        if self.optimizer not in OPTIMIZERS:
            _fail("train.optimizer", f"unknown optimizer {self.optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")
        if self.optimizer == "muon" and not (self.muon_lr > 0 and 0 <= self.muon_momentum < 1):
            _fail(
                "train.muon_lr",
                f"muon_lr={self.muon_lr}, muon_momentum={self.muon_momentum}",
                "use lr > 0, 0 <= momentum < 1",
            )
        if self.schedule not in SCHEDULES:
            _fail("train.schedule", f"unknown schedule {self.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
        fractions = tuple(float(x) for x in self.wsd_fractions)
        if self.schedule == "wsd" and (len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6):
            _fail(
                "train.wsd_fractions",
                f"{self.wsd_fractions} are not three non-negative fractions (warmup, stable, decay) summing to 1",
                "e.g. --config.train.wsd_fractions='(0.01,0.79,0.2)'",
            )
        if self.wsd_decay_shape not in DECAY_SHAPES:
            _fail(
                "train.wsd_decay_shape",
                f"unknown shape {self.wsd_decay_shape!r}",
                f"use one of {', '.join(DECAY_SHAPES)}",
            )
        if self.decay_start_step < 0 or self.decay_start_step >= self.steps:
            _fail(
                "train.decay_start_step",
                f"{self.decay_start_step} not in [0, train.steps={self.steps})",
                "leave it 0 (the wsd fractions decide) or set a step before train.steps",
            )
        if self.init_from and not parse_init_from(self.init_from)[0].strip():
            _fail(
                "train.init_from",
                f"{self.init_from!r} names no run",
                "give the run directory to fork from: --config.train.init_from=RUN (its newest checkpoint) or RUN:STEP",
            )
        if self.z_loss < 0:
            _fail("train.z_loss", f"must be >= 0, got {self.z_loss}", "use 0 (off) or e.g. 1e-4")
        if self.spike_sigma < 0 or self.spike_window < 2:
            _fail(
                "train.spike_sigma",
                f"spike_sigma={self.spike_sigma}, spike_window={self.spike_window}",
                "use spike_sigma 0 (off) or e.g. 6, and a window of at least 2 steps",
            )
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            _fail(
                "train.wandb_project",
                "Weights & Biases is not installed",
                "pip install -e '.[wandb]', or leave train.wandb_project empty",
            )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """In-loop evaluation beyond the validation loss (and its bits per byte, always reported with a tokenizer):
    every tasks_every steps, zero-shot accuracy on these tasks (`resformer evaluate`'s, from local files in
    task_data; task_limit > 0 scores the first items only), to TensorBoard as tasks/{task}/acc."""

    tasks: str = ""  # comma-separated, e.g. piqa,arc_easy
    tasks_every: int = 0
    task_data: str = ""
    task_limit: int = 0

    def __post_init__(self):
        if self.tasks and (self.tasks_every <= 0 or not self.task_data):
            _fail(
                "eval.tasks",
                f"{self.tasks!r} given with tasks_every={self.tasks_every} and task_data={self.task_data!r}",
                "set --config.eval.tasks_every=N and --config.eval.task_data=DIR (the tasks' local files)",
            )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1
    fsdp: int = 1
    # Context parallelism: each sequence split over this many devices (its tokens' activations a slice a device);
    # attention gathers keys and values over the axis. 1: off.
    context: int = 1
    num_devices: int = 0  # 0: every device; n: the first n (e.g. to compare with one device)
    # Logical axis -> mesh axes. Parameters shard their `embed` axis over fsdp.
    rules: tuple = (
        ("batch", ("data", "fsdp")),
        ("embed", "fsdp"),
        ("vocab", None),
        ("mlp", None),
        ("q_heads", None),
        ("kv_heads", None),
        ("head_dim", None),
        ("layers", None),
        ("seq", None),
    )
    device_memory_limit_gb: float = 0.0  # >0: refuse steps needing more per device.
    target: str = ""  # the hardware a preset is sized for, e.g. "8x H100 80GB" (reported by --mode=summary)

    def __post_init__(self):
        if self.context < 1:
            _fail(
                "mesh.context",
                f"must be >= 1, got {self.context}",
                "use 1 (off) or the devices a sequence is split over",
            )


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-host (jax.distributed): how long JAX's coordination service waits. A process that stops sending
    heartbeats for heartbeat_timeout_s is declared dead and every other process is stopped (so a surviving host
    lives on about that long after a peer dies); initialization_timeout_s bounds the wait for all processes to
    join at start-up."""

    heartbeat_timeout_s: int = 100
    initialization_timeout_s: int = 300

    def __post_init__(self):
        for field in ("heartbeat_timeout_s", "initialization_timeout_s"):
            if int(getattr(self, field)) < 1:
                _fail(
                    f"distributed.{field}",
                    f"{getattr(self, field)} is not a positive number of seconds",
                    "use at least 1 (defaults: heartbeat 100, initialization 300)",
                )


@dataclasses.dataclass(frozen=True)
class WatchdogConfig:
    """A stalled run says so (train/watchdog.py): when a phase outlives its budget, every thread's stack goes to
    RUN/watchdog/process_I.txt and stderr and the process exits with status 5, so the rerun resumes."""

    enabled: bool = True
    startup_s: float = 1800.0  # process start to the compile: imports, distributed init, data, the attention probe
    compile_s: float = 3600.0  # the train step's compile, and the loop until its first log window is timed
    step_factor: float = 20.0  # then a batch read or a step may take step_factor x the median log window,
    min_step_s: float = 600.0  # and never less than this
    eval_s: float = 3600.0  # one evaluation (validation sets, in-loop tasks)
    checkpoint_s: float = 1800.0  # a restore, a save's blocking part, the wait for the last save

    def __post_init__(self):
        for field in ("startup_s", "compile_s", "step_factor", "min_step_s", "eval_s", "checkpoint_s"):
            if not float(getattr(self, field)) > 0:
                _fail(
                    f"watchdog.{field}",
                    f"{getattr(self, field)} is not positive",
                    "use a positive number, or --config.watchdog.enabled=False to switch the watchdog off",
                )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    # Steps between checkpoints; 0: 1,000, or a tenth of train.steps where that is fewer (a short run resumes too).
    every_steps: int = 0
    max_to_keep: int = 3
    keep_period: int = 0  # >0: also keep every K-th step for the record.
    async_save: bool = True
    allow_fresh_start: bool = False  # True: start from step 0 even though this workdir once held checkpoints

    def __post_init__(self):
        if self.every_steps < 0:
            _fail(
                "checkpoint.every_steps",
                f"must be a number of steps >= 0, got {self.every_steps}",
                "set N >= 1, or 0 for 1,000 or a tenth of train.steps, whichever is fewer",
            )


# The config's sections in order, read-only: RunConfig's fields, base_config's ConfigDict sections.
SECTIONS = types.MappingProxyType(
    {
        "model": ModelConfig,
        "data": DataConfig,
        "train": TrainConfig,
        "eval": EvalConfig,
        "mesh": MeshConfig,
        "distributed": DistributedConfig,
        "watchdog": WatchdogConfig,
        "checkpoint": CheckpointConfig,
    }
)


def _section(cls, name: str, tree, strict: bool):
    """One section's typed value from its ConfigDict or dict: the fields it lacks take their defaults; a field the
    section does not have is an error where the user wrote it (`strict`), and left out of a saved run's."""
    if isinstance(tree, cls):
        return tree
    given = dict(tree.to_dict() if hasattr(tree, "to_dict") else (tree or {}))
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - known)
    if unknown and strict:
        _fail(f"{name}.{unknown[0]}", f"not a field of config.{name}", f"use one of {', '.join(sorted(known))}")
    if cls is ModelConfig:
        return ModelConfig.of({k: v for k, v in given.items() if k in known})  # checks its kinds itself
    values = {k: _frozen(v) for k, v in given.items() if k in known}
    check_kinds(cls, name, values)
    return cls(**values)


def _frozen(value):
    """Lists (a saved run's JSON) as tuples, nested too: a section is hashable, a static argument to jit."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A run's config, typed and frozen: the sections above, and the checks that read two of them."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    watchdog: WatchdogConfig = dataclasses.field(default_factory=WatchdogConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    @classmethod
    def of(cls, tree, strict: bool = True) -> RunConfig:
        """The typed config of a ConfigDict (the command line's) or a dict (a saved run's: `strict=False` leaves
        out the fields this version no longer has). ConfigError names the first impossible field."""
        if isinstance(tree, RunConfig):
            return tree
        sections = set(tree.keys())
        unknown = sorted(sections - set(SECTIONS))
        if unknown and strict:
            _fail(unknown[0], "not a section of the config", f"use one of {', '.join(SECTIONS)}")
        return cls(
            **{name: _section(kind, name, tree[name], strict) for name, kind in SECTIONS.items() if name in sections}
        )

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def replace(self, **sections) -> RunConfig:
        return dataclasses.replace(self, **sections)

    def with_resolved(self, **sections) -> RunConfig:
        """This config with sections whose values a start resolved (resolve.py: the dtype, the attention impl, the
        fork's step, ...), each typed by its own class; the checks across sections are not run again: they ran when
        this config was typed, once a start."""
        new = copy.copy(self)
        for name, value in sections.items():
            if not isinstance(value, SECTIONS[name]):
                raise TypeError(f"config.{name} must be a {SECTIONS[name].__name__}, got {type(value).__name__}")
            object.__setattr__(new, name, value)
        return new

    @property
    def checkpoint_every_steps(self) -> int:
        """Steps between checkpoints: checkpoint.every_steps, or where 0 (the default) 1,000 or a tenth of
        train.steps, whichever is fewer."""
        return self.checkpoint.every_steps or max(1, min(1000, self.train.steps // 10))

    def __post_init__(self):
        m, d = self.model, self.data
        if d.seq_len > m.max_seq_len:
            _fail(
                "data.seq_len",
                f"{d.seq_len} exceeds model.max_seq_len={m.max_seq_len}",
                "lower data.seq_len or raise model.max_seq_len",
            )
        context = self.mesh.context
        if context > 1 and d.seq_len % (2 * context):
            _fail(
                "mesh.context",
                f"data.seq_len={d.seq_len} does not split into 2 x {context} equal slices (each device holds two, "
                "one from each end, for the causal work to balance)",
                "choose a context size with 2 x context dividing the sequence length",
            )
        if context > 1 and m.attention_impl not in ("auto", *CONTEXT_PARALLEL_IMPLS):
            _fail(
                "model.attention_impl",
                f"{m.attention_impl!r} does not run context-parallel (mesh.context={context}) yet",
                f"use one of {', '.join(CONTEXT_PARALLEL_IMPLS)} or auto, or mesh.context=1",
            )
        if d.document_mask:
            if d.source == "synthetic" and not 0 <= d.eot_id < m.vocab_size:
                _fail(
                    "data.document_mask",
                    "synthetic data has no end-of-text token to split documents at",
                    f"set --config.data.eot_id to a token id below {m.vocab_size}, or use a prepared corpus",
                )
            if m.attention_impl == "cudnn":
                _fail(
                    "data.document_mask",
                    "cuDNN's attention (through jax.nn.dot_product_attention) takes no document mask",
                    "use --config.model.attention_impl=pallas (or auto, which picks among the kernels that mask)",
                )
            if m.mapping == "cross_layer":
                _fail(
                    "data.document_mask", "Eq. 2's cross-layer attention has no document mask", "turn one of them off"
                )


def validate(c) -> RunConfig:
    """Every field that could make a run impossible, checked by typing the config (each section's own checks,
    then RunConfig's): the run's typed config, or ConfigError naming the field and the fix."""
    return RunConfig.of(c)


# A resumed run may change how the model runs (these model fields), and anything outside
# `model` (steps, lr, logging, eval, mesh); not the model's equations or parameters. Whether the
# parameters still fit is checked against the checkpoint's own tree (train/loop.py).
RUNTIME_MODEL_FIELDS = (
    "model.attention_impl",
    "model.remat",
    "model.dtype",
    "model.max_seq_len",
    "model.dropout",
    "model.matmuls",
    "model.norm_impl",
    "model.document_eot",  # data.document_mask: a run may switch it on for a cooldown, or off
)
