"""Config schema: defaults, paper sizes, validation with clear errors.

Every run is described by one ml_collections ConfigDict. `base_config()` holds
every field with its default; `paper_config(size, variant)` fills paper
Table 4; `validate(cfg)` stops on an impossible config with one message that
names the field and the fix.
"""

from __future__ import annotations

import importlib.util

import ml_collections

from resformer_jax.errors import UserError
from resformer_jax.kernels.names import CONTEXT_PARALLEL_IMPLS
from resformer_jax.kernels.names import IMPLS as ATTENTION_IMPLS
from resformer_jax.model.config import ModelConfig

VALUE_RESIDUAL_MODES = ("none", "resformer", "svformer", "neutreno", "resformer+neutreno", "skipv1")
RESFORMER_LAMBDAS = ("fixed", "learnable", "learnable_plus", "sparse", "convex", "gated")
REMAT_POLICIES = ("none", "dots", "attention", "full")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
LOSS_CHUNK_LEN = 128  # LM head + cross entropy fused over this many positions at a time (train/loss.py); 0: full logits

# Paper Table 4: layers, heads, d_model, ffn.
PAPER_SIZES = {
    "2m": (4, 2, 16, 56),
    "82m": (8, 8, 512, 1792),
    "180m": (12, 12, 768, 2688),
    "468m": (24, 16, 1024, 3584),
}

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


class ConfigError(UserError, ValueError):
    """An impossible or inconsistent config; the message names field and fix."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # The model's fields, their defaults and what each means: model/config.py (ModelConfig).
    c.model = ml_collections.ConfigDict(ModelConfig().to_dict())

    c.data = d = ml_collections.ConfigDict()
    d.source = "synthetic"  # synthetic | array_record | tfds | demo
    d.path = ""
    d.seq_len = 2048
    d.mixture = ""  # "DOMAIN=WEIGHT,DOMAIN=WEIGHT" (renormalised); empty: the paper's Table 2 mixture.
    d.seed = 0
    d.num_threads = 2
    d.prefetch = 4
    d.tokenizer_hash = ""  # filled at start from metadata.json, checked on resume.
    # Packed documents: attention within each document only, positions restarting at each (model.document_eot,
    # resolved at start from the corpus's end-of-text token). Off: every token attends to every earlier one of its
    # sequence, across documents, as the paper trains.
    d.document_mask = False
    d.eot_id = -1  # the end-of-text token when the data does not say (synthetic data); -1: the corpus's own
    # With document_mask: whether the loss counts the target after an end-of-text token (a document's first token,
    # predicted from the end of the one before); False leaves it out, as a run of each document alone would.
    d.document_start_loss = True

    c.train = t = ml_collections.ConfigDict()
    t.global_batch = 1024  # sequences per optimizer step
    t.microbatch = 0  # sequences per microbatch (0: no accumulation)
    t.steps = 10000
    t.peak_lr = 6e-4
    t.init_lr = 1e-7
    t.final_lr_ratio = 0.1
    t.warmup_steps = 120
    t.b1 = 0.9
    t.b2 = 0.95
    t.eps = 1e-8
    t.weight_decay = 0.1
    t.grad_clip = 1.0
    t.seed = 0
    t.log_every = 10
    t.eval_every = 500
    t.eval_batches = 4
    t.skip_nonfinite_steps = False
    t.loss_chunk_len = LOSS_CHUNK_LEN
    t.stop_at = 0  # >0: save and exit after this step (for time-limited jobs); the schedule still spans `steps`
    # adamw (the paper) | muon: Muon on the hidden weight matrices (each layer's own, orthogonalised by
    # Newton-Schulz), AdamW with peak_lr on embeddings, LM head, norms, biases and the value-residual scalars.
    t.optimizer = "adamw"
    t.muon_lr = 0.02
    t.muon_momentum = 0.95
    # cosine (the paper: warmup_steps, then cosine to final_lr_ratio) | wsd (warmup, stable, decay: fractions of
    # `steps` summing to 1, the decay in wsd_decay_shape) | constant (warmup_steps, then peak_lr)
    t.schedule = "cosine"
    t.wsd_fractions = (0.01, 0.79, 0.2)
    t.wsd_decay_shape = "1-sqrt"  # linear | cosine | 1-sqrt
    t.decay_start_step = 0  # >0: the WSD decay starts here (a cooldown forked with init_from sets it)
    # RUN:STEP (or RUN, its newest step): start this new run from that run's checkpoint (parameters, optimizer
    # state, the data's position) with the WSD decay starting there: a cooldown forked from a stable run.
    t.init_from = ""
    t.z_loss = 0.0  # PaLM's z-loss: z_loss * mean(log Z^2) of the logits' log-normaliser, added to the loss
    # Loss-spike skipping: a step whose loss or gradient norm is more than spike_sigma standard deviations above
    # the mean of the last spike_window applied steps is not applied (0: off; non-finite steps: skip_nonfinite).
    t.spike_sigma = 0.0
    t.spike_window = 100
    # Per-layer telemetry at each log: gradient, parameter and update norms per layer and kind (attention, MLP,
    # norms, scalars; embeddings and LM head), to TensorBoard as telemetry/{what}/{kind}/layer_NN.
    t.telemetry = False
    # Weights & Biases (pip install -e '.[wandb]'): every scalar also to this project, from process 0; the run id is
    # kept in the run directory, so a resumed run appends to the same W&B run. WANDB_MODE=offline needs no network.
    t.wandb_project = ""

    # In-loop evaluation beyond the validation loss (and its bits per byte, always reported with a tokenizer):
    # every tasks_every steps, zero-shot accuracy on these tasks (`resformer evaluate`'s, from local files in
    # task_data; task_limit > 0 scores the first items only), to TensorBoard as tasks/{task}/acc.
    c.eval = ml_collections.ConfigDict()
    c.eval.tasks = ""  # comma-separated, e.g. piqa,arc_easy
    c.eval.tasks_every = 0
    c.eval.task_data = ""
    c.eval.task_limit = 0

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    # Context parallelism: each sequence split over this many devices (its tokens' activations a slice a device);
    # attention gathers keys and values over the axis. 1: off.
    c.mesh.context = 1
    c.mesh.num_devices = 0  # 0: every device; n: the first n (e.g. to compare with one device)
    # Logical axis -> mesh axes. Parameters shard their `embed` axis over fsdp.
    c.mesh.rules = (
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
    c.mesh.device_memory_limit_gb = 0.0  # >0: refuse steps needing more per device.
    c.mesh.target = ""  # the hardware a preset is sized for, e.g. "8x H100 80GB" (reported by --mode=summary)

    # Multi-host (jax.distributed): how long JAX's coordination service waits. A process that stops sending
    # heartbeats for heartbeat_timeout_s is declared dead and every other process is stopped (so a surviving host
    # lives on about that long after a peer dies); initialization_timeout_s bounds the wait for all processes to
    # join at start-up.
    c.distributed = ml_collections.ConfigDict()
    c.distributed.heartbeat_timeout_s = 100
    c.distributed.initialization_timeout_s = 300

    # A stalled run says so (train/watchdog.py): when a phase outlives its budget, every thread's stack goes to
    # RUN/watchdog/process_I.txt and stderr and the process exits with status 5, so the rerun resumes.
    c.watchdog = w = ml_collections.ConfigDict()
    w.enabled = True
    w.startup_s = 1800.0  # process start to the compile: imports, distributed init, data, the attention probe
    w.compile_s = 3600.0  # the train step's compile, and the loop until its first log window is timed
    w.step_factor = 20.0  # then a batch read or a step may take step_factor x the median log window,
    w.min_step_s = 600.0  # and never less than this
    w.eval_s = 3600.0  # one evaluation (validation sets, in-loop tasks)
    w.checkpoint_s = 1800.0  # a restore, a save's blocking part, the wait for the last save

    c.checkpoint = k = ml_collections.ConfigDict()
    k.every_steps = 1000
    k.max_to_keep = 3
    k.keep_period = 0  # >0: also keep every K-th step for the record.
    k.async_save = True
    k.allow_fresh_start = False  # True: start from step 0 even though this workdir once held checkpoints

    return c


def paper_config(size: str, variant: str = "none") -> ml_collections.ConfigDict:
    """A paper model (Table 4) with the paper's training setup (Sec. 4.1.1)."""
    c = base_config()
    layers, heads, d_model, ffn = PAPER_SIZES[size]
    c.model.num_layers = layers
    c.model.num_heads = heads
    c.model.d_model = d_model
    c.model.ffn_dim = ffn
    c.model.value_residual = variant
    c.model.dtype = "bfloat16"
    c.data.seq_len = 2048
    c.data.source = "array_record"
    # Sized for 8x H100 80GB (the paper's hardware) by `resformer compile --tune --target=h100x8`: the best
    # setting by the compiled step's roofline bound that fits with 10% to spare (docs/kernels-and-compile.md).
    # On fewer or smaller devices set train.microbatch (sequences per accumulation step); the precheck says so.
    c.model.remat, c.model.scan_layers, c.train.microbatch = H100X8_SETTINGS.get(size, ("full", True, 0))
    c.mesh.target = "8x H100 80GB"
    return c


# `compile --tune --target=h100x8`'s best (remat, scan_layers, train.microbatch) per paper size: unrolled layers
# keep what the backward reads in place (a scan copies it into stacked buffers), so nothing is recomputed.
H100X8_SETTINGS = {
    "82m": ("none", False, 0),  # the step's 1,024 sequences in one pass (128 a GPU)
    "180m": ("none", False, 512),  # 64 sequences a GPU, 2 accumulation steps
    "468m": ("none", False, 128),  # 16 sequences a GPU, 8 accumulation steps
}


# Paper Table 3: sequence length -> (total batch, per-GPU batch) on 8 GPUs, 2M tokens a step. The paper writes
# 32,000 and 64,000, but its batch sizes (64, 32) make exactly 2^21 tokens only with 32,768 and 65,536 (and
# 8 GPUs cannot split 66 or 33 sequences of 32,000 / 64,000 evenly), so the presets use the powers of two.
TABLE3 = {512: (4096, 128), 2048: (1024, 32), 8192: (256, 8), 32768: (64, 2), 65536: (32, 1)}
TOKENS_PER_STEP = 2**21


def seq_len_config(size: str, variant: str, seq_len: int) -> ml_collections.ConfigDict:
    """A Table 3 / Fig. 11 run: 2M tokens a step at `seq_len`, sized for 8x H100 80GB (per-GPU micro-batches of
    Table 3, remat=full, flash attention through auto)."""
    if seq_len not in TABLE3:
        raise ConfigError(f"seq_len {seq_len} is not one of Table 3's {sorted(TABLE3)}")
    total, per_gpu = TABLE3[seq_len]
    c = paper_config(size, variant)
    c.data.seq_len = c.model.max_seq_len = seq_len
    c.train.global_batch, c.train.microbatch = total, per_gpu * 8
    c.model.remat, c.model.scan_layers = "full", True  # as measured in docs/kernels-and-compile.md
    c.mesh.num_devices, c.mesh.data, c.mesh.fsdp = 8, -1, 1
    c.mesh.device_memory_limit_gb, c.mesh.target = 80.0, "8x H100 80GB"
    return c


def tiny_config(variant: str = "resformer") -> ml_collections.ConfigDict:
    """A model small enough for tests: several steps a second on 2 CPU cores."""
    c = base_config()
    m = c.model
    m.vocab_size = 256
    m.num_layers = 3
    m.num_heads = 4
    m.d_model = 64
    m.ffn_dim = 128
    m.max_seq_len = 128
    m.value_residual = variant
    m.dtype = "float32"
    m.attention_impl = "xla"
    c.data.seq_len = 32
    c.data.source = "synthetic"
    c.train.global_batch = 8
    c.train.steps = 20
    c.train.warmup_steps = 2
    c.train.peak_lr = 3e-3
    c.train.log_every = 5
    c.train.eval_every = 10
    c.train.eval_batches = 1
    c.checkpoint.every_steps = 10
    c.checkpoint.async_save = False
    return c


_NO_DEFAULT = object()


class MissingField(KeyError):
    """A dotted path with a part that is not there: `parent` (the node that exists, "" for the root) lacks `part`;
    `fields` are the parent's fields."""

    def __init__(self, dotted: str, parent: str, part: str, fields: list[str]):
        super().__init__(dotted)
        self.dotted, self.parent, self.part, self.fields = dotted, parent, part, fields


def get_dotted(tree, dotted: str, default=_NO_DEFAULT):
    """tree["a"]["b"] for "a.b" (a ConfigDict or nested dicts); MissingField (a KeyError) where a part is missing,
    unless a default is given. The one walker of dotted config paths."""
    node, parts = tree, dotted.split(".")
    for i, part in enumerate(parts):
        if not hasattr(node, "keys") or part not in node:
            if default is _NO_DEFAULT:
                fields = list(node.keys()) if hasattr(node, "keys") else []
                raise MissingField(dotted, ".".join(parts[:i]), part, fields)
            return default
        node = node[part]
    return node


def set_dotted(tree, dotted: str, value) -> None:
    """tree["a"]["b"] = value for "a.b" (the parents must exist: KeyError otherwise)."""
    *parents, last = dotted.split(".")
    node = get_dotted(tree, ".".join(parents)) if parents else tree
    node[last] = value


def _fail(field: str, problem: str, fix: str):
    raise ConfigError(f"config.{field}: {problem}. Fix: {fix}.")


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
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in saved.items() if k != "resolved"}
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


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Checks every field that could make a run impossible; returns c."""
    m = c.model
    if m.value_residual not in VALUE_RESIDUAL_MODES:
        _fail(
            "model.value_residual",
            f"unknown mode {m.value_residual!r}",
            f"use one of {', '.join(VALUE_RESIDUAL_MODES)}",
        )
    for name, val in [
        ("num_layers", m.num_layers),
        ("num_heads", m.num_heads),
        ("d_model", m.d_model),
        ("ffn_dim", m.ffn_dim),
        ("vocab_size", m.vocab_size),
        ("max_seq_len", m.max_seq_len),
    ]:
        if not isinstance(val, int) or val <= 0:
            _fail(f"model.{name}", f"must be a positive integer, got {val!r}", "set a positive integer")
    if m.rope_type not in ("default", "linear", "llama3"):
        _fail("model.rope_type", f"unknown RoPE type {m.rope_type!r}", "use default, linear or llama3")
    if not 0.0 <= float(m.dropout) < 1.0:
        _fail("model.dropout", f"{m.dropout} is not a probability below 1", "use 0 (the paper) or e.g. 0.1 (GPT-2)")
    if m.d_model % m.num_heads:
        _fail(
            "model.num_heads",
            f"{m.num_heads} heads do not divide d_model={m.d_model}",
            "choose num_heads dividing d_model",
        )
    if m.num_kv_heads < 0 or m.num_heads % ModelConfig.of(m).kv_heads:
        _fail(
            "model.num_kv_heads",
            f"{m.num_kv_heads} kv heads do not divide num_heads={m.num_heads}",
            "choose num_kv_heads dividing num_heads (0 means num_heads)",
        )
    if ModelConfig.of(m).head_dim % 2:
        _fail(
            "model.num_heads",
            f"head_dim={ModelConfig.of(m).head_dim} is odd, RoPE needs an even head_dim",
            "choose num_heads so d_model/num_heads is even",
        )
    if c.data.seq_len > m.max_seq_len:
        _fail(
            "data.seq_len",
            f"{c.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}",
            "lower data.seq_len or raise model.max_seq_len",
        )
    if c.data.seq_len < 1:
        _fail("data.seq_len", f"must be positive, got {c.data.seq_len}", "set data.seq_len >= 1")
    if m.remat not in REMAT_POLICIES:
        _fail("model.remat", f"unknown policy {m.remat!r}", f"use one of {', '.join(REMAT_POLICIES)}")
    if m.matmuls not in ("auto", "cpu", "plain"):
        _fail("model.matmuls", f"unknown form {m.matmuls!r}", "use auto, cpu or plain")
    if m.attention_impl not in ATTENTION_IMPLS:
        _fail("model.attention_impl", f"unknown impl {m.attention_impl!r}", f"use one of {', '.join(ATTENTION_IMPLS)}")
    if m.dtype not in ("float32", "bfloat16", "float16", "auto"):
        _fail("model.dtype", f"unknown dtype {m.dtype!r}", "use float32, bfloat16 or auto (the faster on this host)")
    if m.resformer_lambdas not in RESFORMER_LAMBDAS:
        _fail(
            "model.resformer_lambdas",
            f"unknown {m.resformer_lambdas!r}",
            f"use one of {', '.join(RESFORMER_LAMBDAS)}",
        )
    kv = m.num_kv_heads or m.num_heads
    if not 0 <= m.value_embeddings <= m.num_layers // 2:
        _fail(
            "model.value_embeddings",
            f"{m.value_embeddings} U-Net pairs of tables need {2 * m.value_embeddings} of the {m.num_layers} layers",
            f"use 0..{m.num_layers // 2}",
        )
    if m.value_embeddings and m.value_residual in ("svformer", "skipv1"):
        _fail(
            "model.value_embeddings",
            f"value embeddings add to a layer's own value V_n, and value_residual={m.value_residual!r} layers >= 2 "
            "have none or only some heads of it",
            "use value_residual none or resformer with value embeddings",
        )
    if m.value_residual == "skipv1" and m.skipv1_reused_heads < 0 and kv % 2:
        _fail(
            "model.skipv1_reused_heads",
            f"SkipV1Former reuses half the value heads, but there are {kv} (odd)",
            f"set --config.model.skipv1_reused_heads=R with R in 0..{kv} (R of each layer's value heads from layer 1)",
        )
    if m.value_residual == "skipv1" and m.skipv1_reused_heads > kv:
        _fail(
            "model.skipv1_reused_heads",
            f"{m.skipv1_reused_heads} reused heads, but layers have {kv} value heads",
            f"use 0..{kv} (or -1: half)",
        )
    if len(tuple(m.lambda_init)) != 2:
        _fail(
            "model.lambda_init",
            f"needs two values (l1, l2), got {m.lambda_init!r}",
            "set e.g. --config.model.lambda_init='(0.5,0.5)'",
        )
    choices = {
        "arch": ("llama", "gpt2"),
        "value_source": ("first", "previous", "mean_of_previous", "mean_of_previous_mixed"),
        "residual_on": ("v", "q", "k"),
        "mapping": ("attention", "identity", "cross_layer"),
        "cla_share": ("kv", "k", "v"),
        "svformer_share": ("v", "q", "k"),
    }
    for name, allowed in choices.items():
        if m[name] not in allowed:
            _fail(f"model.{name}", f"unknown value {m[name]!r}", f"use one of {', '.join(allowed)}")
    resformer = ModelConfig.of(m).mixes_values
    for name, default in (("mapping", "attention"), ("residual_on", "v"), ("value_source", "first")):
        if m[name] != default and not resformer:
            _fail(
                f"model.{name}",
                f"{m[name]!r} is a ResFormer ablation but value_residual={m.value_residual!r}",
                f"set model.value_residual='resformer' or leave this field at {default!r}",
            )
    if (m.svformer_share != "v" or tuple(m.svformer_anchors)) and m.value_residual != "svformer":
        _fail(
            "model.svformer_share",
            "anchors and Q/K sharing are SVFormer options",
            "set model.value_residual='svformer'",
        )
    if m.cla_share_every < 1:
        _fail("model.cla_share_every", "must be >= 1", "use 1 (off) or 2 (CLA2)")
    for a in m.svformer_anchors:
        if not 1 <= a <= m.num_layers:
            _fail("model.svformer_anchors", f"layer {a} outside 1..{m.num_layers}", "list 1-based layer numbers")
    for a in m.sparse_layers:
        if not 2 <= a <= m.num_layers:
            _fail("model.sparse_layers", f"layer {a} outside 2..{m.num_layers}", "list 1-based layer numbers >= 2")
    if m.num_layers < 2 and m.value_residual != "none":
        _fail("model.num_layers", "value residual needs at least 2 layers", "use num_layers >= 2")

    context = int(c.mesh.get("context", 1))
    if context < 1:
        _fail("mesh.context", f"must be >= 1, got {context}", "use 1 (off) or the devices a sequence is split over")
    if context > 1 and c.data.seq_len % (2 * context):
        _fail(
            "mesh.context",
            f"data.seq_len={c.data.seq_len} does not split into 2 x {context} equal slices (each device holds two, "
            "one from each end, for the causal work to balance)",
            "choose a context size with 2 x context dividing the sequence length",
        )
    if context > 1 and m.attention_impl not in ("auto", *CONTEXT_PARALLEL_IMPLS):
        _fail(
            "model.attention_impl",
            f"{m.attention_impl!r} does not run context-parallel (mesh.context={context}) yet",
            f"use one of {', '.join(CONTEXT_PARALLEL_IMPLS)} or auto, or mesh.context=1",
        )

    t = c.train
    if t.global_batch <= 0:
        _fail("train.global_batch", f"must be positive, got {t.global_batch}", "set a positive batch")
    if t.microbatch and t.global_batch % t.microbatch:
        _fail(
            "train.microbatch",
            f"{t.microbatch} does not divide global_batch={t.global_batch}",
            "choose a microbatch dividing the global batch",
        )
    if t.steps <= 0:
        _fail("train.steps", f"must be positive, got {t.steps}", "set train.steps >= 1")
    for field, every in (
        ("train.log_every", t.log_every),
        ("train.eval_every", t.eval_every),
        ("checkpoint.every_steps", c.checkpoint.every_steps),
    ):
        if every <= 0:  # each also happens at the last step: N = train.steps means only there
            _fail(
                field, f"must be a positive number of steps, got {every}", "set N >= 1 (train.steps: only at the end)"
            )
    if t.loss_chunk_len < 0:
        _fail(
            "train.loss_chunk_len",
            f"must be >= 0, got {t.loss_chunk_len}",
            "set a positive block length (e.g. 128), or 0 for full logits",
        )
    if t.warmup_steps < 0 or t.warmup_steps >= t.steps:
        _fail(
            "train.warmup_steps",
            f"{t.warmup_steps} not in [0, train.steps={t.steps})",
            "use fewer warmup steps than total steps",
        )
    if t.optimizer not in OPTIMIZERS:
        _fail("train.optimizer", f"unknown optimizer {t.optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")
    if t.optimizer == "muon" and not (t.muon_lr > 0 and 0 <= t.muon_momentum < 1):
        _fail("train.muon_lr", f"muon_lr={t.muon_lr}, muon_momentum={t.muon_momentum}", "use lr > 0, 0 <= momentum < 1")
    if t.schedule not in SCHEDULES:
        _fail("train.schedule", f"unknown schedule {t.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
    fractions = tuple(float(x) for x in t.wsd_fractions)
    if t.schedule == "wsd" and (len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6):
        _fail(
            "train.wsd_fractions",
            f"{t.wsd_fractions} are not three non-negative fractions (warmup, stable, decay) summing to 1",
            "e.g. --config.train.wsd_fractions='(0.01,0.79,0.2)'",
        )
    if t.wsd_decay_shape not in DECAY_SHAPES:
        _fail("train.wsd_decay_shape", f"unknown shape {t.wsd_decay_shape!r}", f"use one of {', '.join(DECAY_SHAPES)}")
    if t.decay_start_step < 0 or t.decay_start_step >= t.steps:
        _fail(
            "train.decay_start_step",
            f"{t.decay_start_step} not in [0, train.steps={t.steps})",
            "leave it 0 (the wsd fractions decide) or set a step before train.steps",
        )
    if t.init_from and not parse_init_from(t.init_from)[0].strip():
        _fail(
            "train.init_from",
            f"{t.init_from!r} names no run",
            "give the run directory to fork from: --config.train.init_from=RUN (its newest checkpoint) or RUN:STEP",
        )
    if t.z_loss < 0:
        _fail("train.z_loss", f"must be >= 0, got {t.z_loss}", "use 0 (off) or e.g. 1e-4")
    if t.spike_sigma < 0 or t.spike_window < 2:
        _fail(
            "train.spike_sigma",
            f"spike_sigma={t.spike_sigma}, spike_window={t.spike_window}",
            "use spike_sigma 0 (off) or e.g. 6, and a window of at least 2 steps",
        )
    if t.wandb_project and importlib.util.find_spec("wandb") is None:
        _fail(
            "train.wandb_project",
            "Weights & Biases is not installed",
            "pip install -e '.[wandb]', or leave train.wandb_project empty",
        )
    e = c.eval
    if e.tasks and (e.tasks_every <= 0 or not e.task_data):
        _fail(
            "eval.tasks",
            f"{e.tasks!r} given with tasks_every={e.tasks_every} and task_data={e.task_data!r}",
            "set --config.eval.tasks_every=N and --config.eval.task_data=DIR (the tasks' local files)",
        )
    parse_mixture(c.data.mixture)
    if c.data.source not in ("synthetic", "array_record", "tfds", "demo"):
        _fail("data.source", f"unknown source {c.data.source!r}", "use synthetic, array_record, tfds or demo")
    if c.data.get("document_mask", False):
        eot = int(c.data.get("eot_id", -1))
        if c.data.source == "synthetic" and not 0 <= eot < m.vocab_size:
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
            _fail("data.document_mask", "Eq. 2's cross-layer attention has no document mask", "turn one of them off")
    for field in ("startup_s", "compile_s", "step_factor", "min_step_s", "eval_s", "checkpoint_s"):
        if "watchdog" in c and not float(c.watchdog[field]) > 0:
            _fail(
                f"watchdog.{field}",
                f"{c.watchdog[field]} is not positive",
                "use a positive number, or --config.watchdog.enabled=False to switch the watchdog off",
            )
    for field in ("heartbeat_timeout_s", "initialization_timeout_s"):
        if int(c.distributed[field]) < 1:
            _fail(
                f"distributed.{field}",
                f"{c.distributed[field]} is not a positive number of seconds",
                "use at least 1 (defaults: heartbeat 100, initialization 300)",
            )
    return c


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
    "model.document_eot",  # data.document_mask: a run may switch it on for a cooldown, or off
)


def apply_ablation(c: ml_collections.ConfigDict, fields: dict) -> ml_collections.ConfigDict:
    """Sets model fields, resolving size-relative values so one ablation fits any model size:
    LAST3 (the last three layers), MIDDLE (the middle layer), HALF / QUARTER / EIGHTH (of the heads)."""
    m = c.model
    L, H = m.num_layers, m.num_heads
    symbolic = {
        "LAST3": tuple(range(max(2, L - 2), L + 1)),
        "MIDDLE": (L // 2 + 1,),
        "HALF": max(1, H // 2),
        "QUARTER": max(1, H // 4),
        "EIGHTH": max(1, H // 8),
    }
    for k, v in fields.items():
        m[k] = symbolic.get(v, v) if isinstance(v, str) else v
    return c
