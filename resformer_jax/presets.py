"""The presets: the paper's sizes (Table 4) and training setup (Sec. 4.1.1), its sequence-length runs (Table 3),
the tiny test model, and the ablations' size-relative fields; each a ConfigDict of config.py's schema that a config
file returns or edits.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import math
import types

import ml_collections

from resformer_jax.config import base_config
from resformer_jax.errors import ConfigError
from resformer_jax.model.config import LAYER_LIST_FIELDS, layer_list

# Paper Table 4: layers, heads, d_model, ffn.
PAPER_SIZES = {
    "2m": (4, 2, 16, 56),
    "82m": (8, 8, 512, 1792),
    "180m": (12, 12, 768, 2688),
    "468m": (24, 16, 1024, 3584),
}


# The head counts an ablation names (num_kv_heads: "HALF"), resolved by the model's heads.
HEAD_FRACTIONS = types.MappingProxyType({"HALF": 2, "QUARTER": 4, "EIGHTH": 8})


def paper_config(size: str, variant: str = "none") -> ml_collections.ConfigDict:
    """A paper model (Table 4) with the paper's training setup (Sec. 4.1.1)."""
    c = base_config()
    layers, heads, d_model, ffn = PAPER_SIZES[size]
    c.model.update(num_layers=layers, num_heads=heads, d_model=d_model, ffn_dim=ffn, value_residual=variant)
    c.model.dtype = "bfloat16"
    c.data.update(seq_len=2048, source="array_record")
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
    c.model.update(vocab_size=256, num_layers=3, num_heads=4, d_model=64, ffn_dim=128, max_seq_len=128)
    c.model.update(value_residual=variant, dtype="float32", attention_impl="xla")
    c.data.update(seq_len=32, source="synthetic")
    c.train.update(global_batch=8, steps=20, warmup_steps=2, peak_lr=3e-3, log_every=5, eval_every=10, eval_batches=1)
    c.checkpoint.update(every_steps=10, async_save=False)
    return c


@dataclasses.dataclass(frozen=True)
class PublishedModel:
    """A published Llama-family model a scale-out preset copies: its shapes, its parameter count as published, and
    the learning rate, batch and warmup of its recipe (the rest of the recipe is the paper's, Sec. 4.1.1)."""

    name: str
    num_layers: int
    d_model: int
    num_heads: int  # as published
    num_kv_heads: int
    ffn_dim: int
    vocab_size: int  # the embedding's rows: the GPT-NeoX tokenizer's 50,277 ids padded to a multiple of 128
    seq_len: int
    tie_embeddings: bool
    params: int
    peak_lr: float
    sequences_a_step: int
    warmup_steps: int
    source: str
    head_dim: int = 128  # the preset's head width (the attention kernels' blocks take a power of two)

    @property
    def heads(self) -> tuple[int, int]:
        """The preset's (heads, KV heads): d_model // head_dim, the published grouping kept; the same parameters."""
        heads = self.d_model // self.head_dim
        return heads, heads * self.num_kv_heads // self.num_heads


# Each copies a model trained with the GPT-NeoX tokenizer this project prepares data with, so the parameter count
# is the copied model's (a Llama-2-vocabulary model would be 2-7% off it). Their notes: docs/scaling-out.md.
SCALE_MODELS = types.MappingProxyType(
    {
        "1b": PublishedModel(
            "OLMo-1B", 16, 2048, 16, 16, 8192, 50304, 2048, True, 1_176_764_416, 4e-4, 2048, 2000,
            "Groeneveld et al. 2024, OLMo (arXiv 2402.00838), Sec. 3 and Table 1; allenai/OLMo-1B's config",
        ),
        "3b": PublishedModel(
            "StableLM-3B-4E1T", 32, 2560, 32, 32, 6912, 50304, 4096, False, 2_795_443_200, 3.2e-4, 1024, 4800,
            "Tow et al. 2023, StableLM-3B-4E1T technical report; stabilityai/stablelm-3b-4e1t's model card",
        ),  # run as 20 heads of 128, not 32 of 80: padded to 128, a 3B step's MFU bound on 8 H100s was 0.630
        "7b": PublishedModel(
            "OLMo-7B", 32, 4096, 32, 32, 11008, 50304, 2048, False, 6_888_095_744, 3e-4, 2048, 5000,
            "Groeneveld et al. 2024, OLMo (arXiv 2402.00838), Sec. 3 and Table 1; allenai/OLMo-7B's config",
        ),
    }
)  # fmt: skip
TOKENS_PER_PARAM = 20  # the token budget: Hoffmann et al. 2022's compute-optimal 20 tokens a parameter


@dataclasses.dataclass(frozen=True)
class ClusterSetting:
    """How a scale-out preset runs on one cluster: its compile target, the mesh, the microbatch (sequences a
    gradient-accumulation step over all devices) and the remat policy, chosen by `resformer compile`."""

    target: str  # --target
    nodes: int  # --nodes (GPU)
    data: int
    fsdp: int
    microbatch: int
    remat: str
    scan_layers: bool
    hardware: str  # mesh.target: what the preset is sized for


# Chosen by compiling each preset for each cluster: the best step bound that leaves 10% of memory free, of remat
# none/dots/full and microbatches by powers of two (docs/scaling-out.md, the table and what was tried).
CLUSTERS = ("h100x8", "4xh100x8", "v5p-128", "v6e-64")
SCALE_SETTINGS: types.MappingProxyType = types.MappingProxyType(
    {
        ("1b", "h100x8"): ClusterSetting("h100x8", 1, 1, 8, 128, "dots", True, "8x H100 80GB"),
        ("1b", "4xh100x8"): ClusterSetting("h100x8", 4, 4, 8, 512, "dots", True, "32x H100 80GB (4 nodes)"),
        ("1b", "v5p-128"): ClusterSetting("v5p-128", 1, 1, 64, 256, "none", True, "64x TPU v5p"),
        ("1b", "v6e-64"): ClusterSetting("v6e-64", 1, 1, 64, 256, "dots", False, "64x TPU v6e"),
        ("3b", "h100x8"): ClusterSetting("h100x8", 1, 1, 8, 32, "dots", True, "8x H100 80GB"),
        ("3b", "4xh100x8"): ClusterSetting("h100x8", 4, 4, 8, 128, "dots", True, "32x H100 80GB (4 nodes)"),
        ("3b", "v5p-128"): ClusterSetting("v5p-128", 1, 1, 64, 128, "none", True, "64x TPU v5p"),
        ("3b", "v6e-64"): ClusterSetting("v6e-64", 1, 1, 64, 64, "dots", False, "64x TPU v6e"),
        ("7b", "h100x8"): ClusterSetting("h100x8", 1, 1, 8, 32, "dots", True, "8x H100 80GB"),
        ("7b", "4xh100x8"): ClusterSetting("h100x8", 4, 4, 8, 128, "dots", True, "32x H100 80GB (4 nodes)"),
        ("7b", "v5p-128"): ClusterSetting("v5p-128", 1, 1, 64, 256, "dots", True, "64x TPU v5p"),
        ("7b", "v6e-64"): ClusterSetting("v6e-64", 1, 1, 64, 64, "dots", True, "64x TPU v6e"),
    }
)


def cluster_for(target: str, nodes: int = 1, slices: int = 1) -> str | None:
    """The cluster of CLUSTERS that `resformer compile --target=TARGET --nodes=NODES` compiles for, None where none."""
    if slices != 1:
        return None
    asked = (target.strip().lower(), nodes)
    return next((c for c in CLUSTERS if (SCALE_SETTINGS["1b", c].target, SCALE_SETTINGS["1b", c].nodes) == asked), None)


def scale_config(size: str, variant: str = "none", cluster: str = "h100x8") -> ml_collections.ConfigDict:
    """A scale-out preset: the shapes of the published model SCALE_MODELS[size] copies, the paper's recipe (AdamW
    betas, weight decay, clipping, warmup then cosine) with that model's learning rate, batch and warmup, a token
    budget of 20 tokens a parameter, and the mesh, microbatch and remat chosen for `cluster` (one of CLUSTERS)."""
    if size not in SCALE_MODELS:
        raise ConfigError(f"unknown scale-out size {size!r}; choose one of {', '.join(SCALE_MODELS)}")
    if cluster not in CLUSTERS:
        raise ConfigError(
            f"unknown cluster {cluster!r} for the {size} preset; choose one of {', '.join(CLUSTERS)} "
            f"(e.g. --config=configs/resformer_{size}.py:v5p-128), or compile it for yours with `resformer compile "
            "--tune`"
        )
    p, s = SCALE_MODELS[size], SCALE_SETTINGS[size, cluster]
    c = base_config()
    c.model.update(
        num_layers=p.num_layers, d_model=p.d_model, num_heads=p.heads[0], num_kv_heads=p.heads[1],
        ffn_dim=p.ffn_dim, vocab_size=p.vocab_size, max_seq_len=p.seq_len, tie_embeddings=p.tie_embeddings,
        value_residual=variant, dtype="bfloat16", remat=s.remat, scan_layers=s.scan_layers,
    )  # fmt: skip
    c.data.update(seq_len=p.seq_len, source="array_record")
    tokens_a_step = p.sequences_a_step * p.seq_len
    c.train.update(
        global_batch=p.sequences_a_step,
        microbatch=0 if s.microbatch >= p.sequences_a_step else s.microbatch,
        peak_lr=p.peak_lr,
        warmup_steps=p.warmup_steps,
        steps=math.ceil(TOKENS_PER_PARAM * p.params / tokens_a_step),
        eval_every=1000,
    )
    c.mesh.update(data=s.data, fsdp=s.fsdp, target=s.hardware)
    return c


def apply_ablation(c: ml_collections.ConfigDict, fields: dict) -> ml_collections.ConfigDict:
    """Sets model fields, resolving size-relative values so one ablation fits any model size: the layer lists'
    names (MIDDLE, LAST3: model/config.py's LAYER_NAMES, which the command line takes too) and HALF / QUARTER /
    EIGHTH of the heads."""
    m = c.model
    for k, v in fields.items():
        if k in LAYER_LIST_FIELDS:
            v = layer_list(k, v, m.num_layers)
        elif isinstance(v, str) and v in HEAD_FRACTIONS:
            v = max(1, m.num_heads // HEAD_FRACTIONS[v])
        m[k] = v
    return c
