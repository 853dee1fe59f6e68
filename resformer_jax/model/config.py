"""The model's typed, frozen config: every field with its default (the one place defaults live, for new runs and
for runs saved before a field existed), derived values as properties, hashable so jit can take it as static.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any

import numpy as np

from resformer_jax.errors import ConfigError
from resformer_jax.kernels.names import IMPLS as ATTENTION_IMPLS

VALUE_RESIDUAL_MODES = ("none", "resformer", "svformer", "neutreno", "resformer+neutreno", "skipv1")
RESFORMER_LAMBDAS = ("fixed", "learnable", "learnable_plus", "sparse", "convex", "gated")
REMAT_POLICIES = ("none", "dots", "attention", "full")
# The other fields with a closed set of values.
CHOICES = (
    ("arch", ("llama", "gpt2")),
    ("rope_type", ("default", "linear", "llama3")),
    ("value_source", ("first", "previous", "mean_of_previous", "mean_of_previous_mixed")),
    ("residual_on", ("v", "q", "k")),
    ("mapping", ("attention", "identity", "cross_layer")),
    ("cla_share", ("kv", "k", "v")),
    ("svformer_share", ("v", "q", "k")),
    ("matmuls", ("auto", "cpu", "plain", "rounded")),
    ("norm_impl", ("auto", "pallas", "xla")),
    ("dtype", ("float32", "bfloat16", "float16", "auto")),
)

# The names a layer list (sparse_layers, svformer_anchors) takes besides 1-based layer numbers, as the ablation
# configs write them, resolved by the model's depth L so one ablation fits any size.
LAYER_NAMES = types.MappingProxyType(
    {
        "LAST3": lambda L: tuple(range(max(2, L - 2), L + 1)),  # the last three layers (never layer 1)
        "MIDDLE": lambda L: (L // 2 + 1,),  # the middle layer
    }
)
LAYER_LIST_FIELDS = ("sparse_layers", "svformer_anchors")

# NeuTRENO's lambda when model.neutreno_lambda < 0 (the paper's defaults, Sec. 4.4): alone, and with ResFormer.
NEUTRENO_DEFAULT = 0.4
NEUTRENO_WITH_RESFORMER = 0.2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str = "llama"  # llama: RMSNorm, SwiGLU, RoPE | gpt2: LayerNorm, GELU MLP, learned positions, biases
    vocab_size: int = 50277
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 0  # 0: same as num_heads (MHA); fewer for GQA/MQA
    d_model: int = 512
    ffn_dim: int = 1792
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    # RoPE scaling, for imported checkpoints (Llama 3.1: llama3, factor 8, low 1, high 4, original 8,192):
    # default (plain RoPE) | linear | llama3, with Hugging Face's rope_scaling fields.
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Paper Table 4: "Tie Word Embedding: False", for every architecture (the authors' GPT-2 run is untied too);
    # True reads the logits off the input embedding (GPT-2's original form).
    tie_embeddings: bool = False
    # GPT-2's init of the output projections (attention out, MLP down): std init_std / sqrt(2 * num_layers).
    scaled_output_init: bool = False
    # Dropout on the embeddings and on each residual branch's output (GPT-2's embd_pdrop and resid_pdrop; the
    # attention probabilities are not dropped: the fused kernels have no such input). The paper's text: 0.
    dropout: float = 0.0
    value_residual: str = "none"  # none | resformer | svformer | neutreno | resformer+neutreno | skipv1
    # fixed | learnable | learnable_plus | sparse | convex (one learnable l a layer: (1 - l) V_n + l V_1) |
    # gated (a per-head, per-token gate from the layer input: (1 - g) V_n + g V_1)
    resformer_lambdas: str = "fixed"
    # SkipV1Former: how many of a layer's value heads (the last ones) are layer 1's; -1: half of them
    skipv1_reused_heads: int = -1
    # Value embeddings (modded-nanogpt): N U-Net pairs of per-token tables added to the own values of layers 1..N
    # and L-N+1..L (layer i and layer L+1-i share table i); 0: none. Mixed by two learnable scalars a layer
    # (a V_n + b VE, init 1/2, 1/2), or with value_embedding_gate by a per-head gate of the layer input.
    value_embeddings: int = 0
    value_embedding_gate: bool = False
    lambda_init: tuple[float, float] = (0.5, 0.5)  # (l1 on the earlier value, l2 on V_n), Eq. 7
    sparse_layers: tuple[int, ...] = ()  # 1-based layers where l1 != 0 for `sparse`
    sparse_lambda: float = 5.0
    neutreno_lambda: float = -1.0  # < 0: the paper's default (0.4 alone, 0.2 with resformer)
    # first | previous | mean_of_previous (Fig. 8; with the attention mapping: Eq. 5, (1/n) sum_{i<=n} V_i) |
    # mean_of_previous_mixed (Eq. 7's mix of the mean of V_1..V_{n-1} with V_n)
    value_source: str = "first"
    residual_on: str = "v"  # v | q | k (Fig. 6)
    mapping: str = "attention"  # attention (Eq. 4) | identity (Eq. 6) | cross_layer (Eq. 2)
    denseformer: bool = False
    cla_share_every: int = 1  # 2 = CLA2: layers reuse the previous layer's K/V
    cla_share: str = "kv"  # kv | k | v (Fig. 4)
    svformer_anchors: tuple[int, ...] = ()  # 1-based layers that recompute the shared value (Fig. 14)
    svformer_share: str = "v"  # v | q | k (Fig. 13)
    # Packed documents (data.document_mask, resolved from the corpus): the token that ends a document; attention
    # is block-diagonal causal (a token attends within its own document) and positions restart at each one.
    # -1: one sequence, as the paper trains.
    document_eot: int = -1
    dtype: str = "float32"  # compute dtype (auto: resolved by the setup); parameters are always float32
    scan_layers: bool = True
    remat: str = "none"  # none | dots | attention | full
    # every `auto` below is resolved in resolve.py alone (a run's start, or for_backend), before the model is built
    attention_impl: str = "auto"
    # auto | pallas | xla: RMSNorm in the Pallas kernels (kernels/pallas_norm.py; auto: on a GPU where they apply)
    # or as XLA's fusions
    norm_impl: str = "auto"
    matmuls: str = "auto"  # auto | cpu | plain: XLA:CPU's fast forms or the accelerators' (auto: per platform);
    # rounded: the decode engine's on a CPU with a bf16 or fp16 model (resolve.serving_model)

    def __post_init__(self):
        """The model's own fields checked where they are declared: ConfigError names the first impossible one."""
        check_kinds(type(self), "model", dataclasses.asdict(self))
        for name in LAYER_LIST_FIELDS:  # MIDDLE, LAST3 and numbers given as text, as layer numbers
            object.__setattr__(self, name, layer_list(name, getattr(self, name), self.num_layers))
        self._check_shape()
        self._check_impls()
        self._check_variant()

    def _check_shape(self) -> None:
        """The mode, the sizes and what the heads must divide."""
        if self.value_residual not in VALUE_RESIDUAL_MODES:
            _fail(
                "value_residual",
                f"unknown mode {self.value_residual!r}",
                f"use one of {', '.join(VALUE_RESIDUAL_MODES)}",
            )
        for name in ("num_layers", "num_heads", "d_model", "ffn_dim", "vocab_size", "max_seq_len"):
            val = getattr(self, name)
            if not isinstance(val, int) or val <= 0:
                _fail(name, f"must be a positive integer, got {val!r}", "set a positive integer")
        for name, allowed in CHOICES:
            if getattr(self, name) not in allowed:
                _fail(name, f"unknown value {getattr(self, name)!r}", f"use one of {', '.join(allowed)}")
        if not 0.0 <= float(self.dropout) < 1.0:
            _fail("dropout", f"{self.dropout} is not a probability below 1", "use 0 (the paper) or e.g. 0.1 (GPT-2)")
        if self.d_model % self.num_heads:
            _fail(
                "num_heads",
                f"{self.num_heads} heads do not divide d_model={self.d_model}",
                "choose num_heads dividing d_model",
            )
        if self.num_kv_heads < 0 or self.num_heads % self.kv_heads:
            _fail(
                "num_kv_heads",
                f"{self.num_kv_heads} kv heads do not divide num_heads={self.num_heads}",
                "choose num_kv_heads dividing num_heads (0 means num_heads)",
            )
        if self.head_dim % 2:
            _fail(
                "num_heads",
                f"head_dim={self.head_dim} is odd, RoPE needs an even head_dim",
                "choose num_heads so d_model/num_heads is even",
            )

    def _check_impls(self) -> None:
        """Remat, norm and attention impls and the lambda mode: known names, and kernels that apply."""
        if self.remat not in REMAT_POLICIES:
            _fail("remat", f"unknown policy {self.remat!r}", f"use one of {', '.join(REMAT_POLICIES)}")
        if self.norm_impl == "pallas" and not self.norm_kernel_applies:
            _fail(
                "norm_impl",
                f"the Pallas norm kernels take Llama's RMSNorm with d_model a power of two (a block spans a row), "
                f"not arch={self.arch!r} with d_model={self.d_model}",
                "use norm_impl=auto or xla",
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            _fail("attention_impl", f"unknown impl {self.attention_impl!r}", f"use one of {', '.join(ATTENTION_IMPLS)}")
        if self.resformer_lambdas not in RESFORMER_LAMBDAS:
            _fail(
                "resformer_lambdas",
                f"unknown {self.resformer_lambdas!r}",
                f"use one of {', '.join(RESFORMER_LAMBDAS)}",
            )

    def _check_variant(self) -> None:
        """The value-residual variant's own fields: value embeddings, SkipV1Former's heads, the ablations."""
        kv = self.kv_heads
        if not 0 <= self.value_embeddings <= self.num_layers // 2:
            _fail(
                "value_embeddings",
                f"{self.value_embeddings} U-Net pairs of tables need {2 * self.value_embeddings} of the "
                f"{self.num_layers} layers",
                f"use 0..{self.num_layers // 2}",
            )
        if self.value_embeddings and self.value_residual in ("svformer", "skipv1"):
            _fail(
                "value_embeddings",
                f"value embeddings add to a layer's own value V_n, and value_residual={self.value_residual!r} "
                "layers >= 2 have none or only some heads of it",
                "use value_residual none or resformer with value embeddings",
            )
        if self.value_residual == "skipv1" and self.skipv1_reused_heads < 0 and kv % 2:
            _fail(
                "skipv1_reused_heads",
                f"SkipV1Former reuses half the value heads, but there are {kv} (odd)",
                f"set --config.model.skipv1_reused_heads=R with R in 0..{kv} (R of each layer's value heads from "
                "layer 1)",
            )
        if self.value_residual == "skipv1" and self.skipv1_reused_heads > kv:
            _fail(
                "skipv1_reused_heads",
                f"{self.skipv1_reused_heads} reused heads, but layers have {kv} value heads",
                f"use 0..{kv} (or -1: half)",
            )
        if len(tuple(self.lambda_init)) != 2:
            _fail(
                "lambda_init",
                f"needs two values (l1, l2), got {self.lambda_init!r}",
                "set e.g. --config.model.lambda_init='(0.5,0.5)'",
            )
        for name, default in (("mapping", "attention"), ("residual_on", "v"), ("value_source", "first")):
            if getattr(self, name) != default and not self.mixes_values:
                _fail(
                    name,
                    f"{getattr(self, name)!r} is a ResFormer ablation but value_residual={self.value_residual!r}",
                    f"set model.value_residual='resformer' or leave this field at {default!r}",
                )
        if (self.svformer_share != "v" or tuple(self.svformer_anchors)) and self.value_residual != "svformer":
            _fail(
                "svformer_share", "anchors and Q/K sharing are SVFormer options", "set model.value_residual='svformer'"
            )
        if self.cla_share_every < 1:
            _fail("cla_share_every", "must be >= 1", "use 1 (off) or 2 (CLA2)")
        for a in self.svformer_anchors:
            if not 1 <= a <= self.num_layers:
                _fail("svformer_anchors", f"layer {a} outside 1..{self.num_layers}", "list 1-based layer numbers")
        for a in self.sparse_layers:
            if not 2 <= a <= self.num_layers:
                _fail("sparse_layers", f"layer {a} outside 2..{self.num_layers}", "list 1-based layer numbers >= 2")
        if self.num_layers < 2 and self.value_residual != "none":
            _fail("num_layers", "value residual needs at least 2 layers", "use num_layers >= 2")

    @classmethod
    def of(cls, m: ModelConfig | Mapping[str, Any] | Any) -> ModelConfig:
        """The typed config of a model ConfigDict or dict (a saved run's included): fields it lacks take their
        defaults, except that a GPT-2 run saved before `tie_embeddings` existed was tied (its checkpoints hold
        no lm_head). Fields this version does not know are left out."""
        if isinstance(m, ModelConfig):
            return m
        d = cls.upgrade(dict(m.to_dict() if hasattr(m, "to_dict") else m))
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for name, value in d.items():
            if name not in known:
                continue
            if isinstance(value, list):
                value = tuple(value)
            kwargs[name] = value
        return cls(**kwargs)

    @staticmethod
    def upgrade(saved: dict[str, Any]) -> dict[str, Any]:
        """A saved run's model dict with the meaning it had when saved: a GPT-2 run saved before
        `tie_embeddings` existed was tied. (Fields it lacks otherwise take this class's defaults.)"""
        if saved.get("arch") == "gpt2" and "tie_embeddings" not in saved:
            return {**saved, "tie_embeddings": True}
        return saved

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived values

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads where it is 0 (MHA)."""
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def uses_rope(self) -> bool:
        return self.arch == "llama"

    @property
    def output_init_std(self) -> float:
        """The init std of the output projections (attention out, MLP down): GPT-2's scaled form when asked."""
        return self.init_std / (2 * self.num_layers) ** 0.5 if self.scaled_output_init else self.init_std

    @property
    def norm_kernel_applies(self) -> bool:
        """Whether the Pallas norm kernels take this model's norm: Llama's RMSNorm, d_model a power of two (>= 16)."""
        return self.arch == "llama" and self.d_model >= 16 and self.d_model & (self.d_model - 1) == 0

    @property
    def norms_in_kernel(self) -> bool:
        """RMSNorm in the Pallas kernels (kernels/pallas_norm.py): one read of the residual stream forward, one pass
        backward with the residual's gradient added."""
        return self.norm_impl == "pallas"

    @property
    def mixes_values(self) -> bool:
        """ResFormer's mix (Eq. 7) of an earlier value into V_n, alone or with NeuTRENO."""
        return self.value_residual in ("resformer", "resformer+neutreno")

    @property
    def uses_neutreno(self) -> bool:
        """NeuTRENO's correction (Eq. 8) after the attention."""
        return self.value_residual in ("neutreno", "resformer+neutreno")

    @property
    def shares_first_value(self) -> bool:
        """SVFormer (Eq. 10): layers >= 2 take something (V, or Q/K in Fig. 13) from layer 1."""
        return self.value_residual == "svformer"

    @property
    def learns_lambdas(self) -> bool:
        """ResFormer with trainable mixing weights (logged per layer to TensorBoard)."""
        return self.mixes_values and self.resformer_lambdas in ("learnable", "learnable_plus", "convex")

    @property
    def gates_values(self) -> bool:
        """ResFormer whose mix is a learned gate of the layer input, per value head and token."""
        return self.mixes_values and self.resformer_lambdas == "gated"

    def value_table(self, layer: int | None) -> int:
        """The value-embedding table 1-based `layer` adds to its value (U-Net: layers i and L+1-i share table
        i - 1), or -1 for none."""
        n, L = self.value_embeddings, self.num_layers
        if layer is None or n <= 0:
            return -1
        if layer <= n:
            return layer - 1
        return L - layer if layer > L - n else -1

    @property
    def reuses_first_value_heads(self) -> bool:
        """SkipV1Former: layers >= 2 take some of their value heads from layer 1."""
        return self.value_residual == "skipv1"

    @property
    def skipv1_heads(self) -> int:
        """The value heads a SkipV1Former layer >= 2 takes from layer 1 (its last ones); 0 otherwise."""
        if not self.reuses_first_value_heads:
            return 0
        return self.kv_heads // 2 if self.skipv1_reused_heads < 0 else self.skipv1_reused_heads

    @property
    def neutreno(self) -> float:
        """Eq. 8's lambda as used: the field, or the paper's default where it is negative."""
        if self.neutreno_lambda >= 0:
            return float(self.neutreno_lambda)
        return NEUTRENO_WITH_RESFORMER if self.value_residual == "resformer+neutreno" else NEUTRENO_DEFAULT


def _fail(field: str, problem: str, fix: str):
    raise ConfigError(f"config.model.{field}: {problem}. Fix: {fix}.")


def layer_list(field: str, value, num_layers: int) -> tuple[int, ...]:
    """A layer-list field's 1-based layer numbers: numbers (or their text) and LAYER_NAMES, in any mix, from a tuple,
    a list or comma-separated text (the command line's `MIDDLE` arrives as ("MIDDLE",), `3,x` as ("3,x",))."""
    items = [value] if isinstance(value, str) else list(value)
    out: list[int] = []
    for item in items:
        for part in item.split(",") if isinstance(item, str) else [item]:
            part = part.strip() if isinstance(part, str) else part
            if isinstance(part, str) and part in LAYER_NAMES:
                out += LAYER_NAMES[part](num_layers)
            elif (isinstance(part, numbers.Integral) and not isinstance(part, bool)) or (
                isinstance(part, str) and part.isdigit()
            ):
                out.append(int(part))
            elif part != "":
                _fail(
                    field,
                    f"{part!r} (in {value!r}) is neither a layer number nor one of {', '.join(LAYER_NAMES)}",
                    f"write 1-based layer numbers or a name, e.g. --config.model.{field}=2,4 or "
                    f"--config.model.{field}={next(iter(LAYER_NAMES))}",
                )
    return tuple(out)


def _kind_problem(kind, value) -> str | None:
    """The kind `value` should be as a field of type `kind` (None: it is)."""
    origin = typing.get_origin(kind)
    if kind is bool:
        return None if isinstance(value, (bool, np.bool_)) else "true or false"
    if kind is int:
        return None if isinstance(value, numbers.Integral) and not isinstance(value, bool) else "an integer"
    if kind is float:
        return None if isinstance(value, numbers.Real) and not isinstance(value, bool) else "a number"
    if kind is str:
        return None if isinstance(value, str) else "text"
    if kind is tuple or origin is tuple:
        args = typing.get_args(kind)
        item_kind = args[0] if args else None
        what = {int: "integers", float: "numbers"}.get(item_kind, "items") if item_kind else "items"
        if not isinstance(value, (tuple, list)):
            return f"a list of {what}"
        for item in value:
            if item_kind in (int, float) and _kind_problem(item_kind, item):
                return f"a list of {what}"
            if item_kind is None and not (
                isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
            ):
                return "a list of (name, value) pairs"
    return None


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_kinds(cls, section: str, values: Mapping[str, Any]) -> None:
    """Each of a config section's values is of its field's declared kind (an integer, a number, true or false,
    text, a list of these): ConfigError naming the field, the value and the kind otherwise, before any check
    compares or converts it. The one check of kinds for every section (config.py's sections call it too)."""
    hints = _hints(cls)
    for name, value in values.items():
        if name not in hints or (cls is ModelConfig and name in LAYER_LIST_FIELDS):  # layer_list checks these
            continue
        want = _kind_problem(hints[name], value)
        if want:
            raise ConfigError(
                f"config.{section}.{name}: {value!r} is not {want}. Fix: give {want}, e.g. "
                f"--config.{section}.{name}={_example(hints[name], cls, name)}."
            )


def _example(kind, cls, name) -> str:
    """The field's default, written as the command line takes it."""
    default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
    if isinstance(default, tuple) and default and isinstance(default[0], tuple):
        return repr(default)
    return ",".join(str(x) for x in default) if isinstance(default, tuple) else str(default)
