"""The arithmetic of performance, in one place: FLOPs per token, MFU, peak FLOP/s (datasheet on
accelerators, measured on CPU), a compiled step's memory, the analytic memory estimate, and the model
summary `--mode=summary` prints. The trainer, the benchmarks and the commands all count here."""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from resformer_jax.chips import chip_of_device
from resformer_jax.model.transformer import cache_bytes_per_token, param_counts, param_shapes
from resformer_jax.optimizer import make_optimizer

if TYPE_CHECKING:
    from resformer_jax.config import RunConfig


@functools.cache
def measure_cpu_matmul_peak(sizes=(1024, 1536), repeats: int = 8, dtype: str = "float32") -> float:
    """Matmul FLOP/s of this host at `dtype` (inputs; fp32 accumulation), the best of several sizes and
    repeats (all local CPU devices share the cores, so this is the peak of all of them together)."""
    return max(sample_cpu_matmul_peak(n, repeats, dtype) for n in sizes)


def sample_cpu_matmul_peak(n: int = 1024, repeats: int = 8, dtype: str = "float32", shape=None) -> float:
    """One fresh sample of the matmul FLOP/s (best of `repeats`), not cached: a shared host's throughput
    drifts, so benchmarks sample it next to the work they time. `shape` = (M, K, N) instead of n^3."""
    m, k, n_ = shape or (n, n, n)
    a, b = jnp.ones((m, k), dtype), jnp.ones((k, n_), dtype)
    f = _matmul_fn()
    f(a, b).block_until_ready()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = max(best, 2 * m * k * n_ / (time.perf_counter() - t))
    return best


@functools.lru_cache(maxsize=1)
def _matmul_fn():
    # fp32 accumulation: the form the model's matmuls take (and XLA:CPU's fast bf16 path)
    return jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))


def time_cpu_matmul(shape: tuple[int, int, int], dtype: str) -> float:
    """Seconds of one [M, K] x [K, N] matmul at `dtype` (fp32 accumulation), compiled and warmed first."""
    m, k, n = shape
    return 2 * m * k * n / sample_cpu_matmul_peak(repeats=1, dtype=dtype, shape=shape)


def faster_cpu_dtype(
    m, tokens: int, min_gain: float = 1.5, rounds: int = 7, timer=time_cpu_matmul, has_bf16=None
) -> tuple[str, str]:
    """("bfloat16" or "float32", why), the same for the same command on the same machine. A CPU without bf16
    matmul instructions (AVX-512 BF16 or AMX) converts bf16 to fp32 and gains nothing: float32, not timed.
    Otherwise the MLP's matmul ([tokens, d_model] x [d_model, ffn_dim]) timed in `rounds` interleaved rounds (fp32,
    bf16, fp32, ...; each the best of 3), and bf16 only if the median round's speed-up is at least `min_gain`:
    such CPUs measure 2-10x, so a busy host's noise around equal speeds cannot flip it. `timer(shape, dtype)`:
    seconds of one matmul (tests inject a clock)."""
    has_bf16 = cpu_has_bf16_matmul() if has_bf16 is None else has_bf16
    if not has_bf16:
        return "float32", "this CPU has no AVX-512 BF16 or AMX (bf16 would be converted to fp32); not timed"
    shape = (min(max(tokens, 64), 8192), m.d_model, m.ffn_dim)  # rows capped: representative, never huge
    flops = 2 * shape[0] * shape[1] * shape[2]
    gains, f32s, b16s = [], [], []
    for _ in range(rounds):
        f32 = min(timer(shape, "float32") for _ in range(3))
        b16 = min(timer(shape, "bfloat16") for _ in range(3))
        f32s.append(flops / f32)
        b16s.append(flops / b16)
        gains.append(f32 / b16)
    gain = float(np.median(gains))
    choice = "bfloat16" if gain >= min_gain else "float32"
    return choice, (
        f"bf16 {np.median(b16s) / 1e9:.0f} vs fp32 {np.median(f32s) / 1e9:.0f} GFLOP/s (median of {rounds} "
        f"interleaved rounds; bf16/fp32 {gain:.2f}x, bf16 only at >= {min_gain:g}x) at the MLP's matmul "
        f"[{shape[0]}x{shape[1]}]x[{shape[1]}x{shape[2]}]; decided once per run: a resumed run keeps it"
    )


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX-512 BF16 or AMX), from /proc/cpuinfo (True where
    unreadable: no hint is better than a wrong one)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return True
    return not flags or any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def device_peak_flops(dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s of all devices together, where the number comes from). On CPU measured at the
    compute dtype (bf16 matmuls run about twice as fast where the CPU has bf16 instructions)."""
    devs = jax.devices()
    kind = devs[0].device_kind
    if devs[0].platform == "cpu":
        name = "bf16" if dtype == "bfloat16" else "fp32"
        return measure_cpu_matmul_peak(dtype=dtype), f"measured {name} matmul peak of this host's CPU"
    chip = chip_of_device(kind)
    if chip is not None:
        return chip.peak_flops * len(devs), f"{chip.kind} table peak x {len(devs)} devices"
    return float("nan"), f"unknown device kind {kind!r}: add it to resformer_jax/chips.py"


@dataclasses.dataclass(frozen=True)
class ModelFlops:
    """Parameter counts and training FLOPs per token of a model config."""

    params_total: int
    params_non_embedding: int
    per_token: float  # the model's own count: every matmul, causal attention at half (flops_per_token)
    per_token_6n: float  # the 6N convention, N the non-embedding parameters
    attention_per_token: float = 0.0  # of per_token: attention's QK^T and AV over whole sequences

    def attending(self, fraction: float) -> ModelFlops:
        """The count where attention keeps `fraction` of a whole sequence's causal pairs (packed documents
        masked: model.transformer.attended_fraction)."""
        per_token = self.per_token - (1.0 - fraction) * self.attention_per_token
        return dataclasses.replace(self, per_token=per_token, attention_per_token=fraction * self.attention_per_token)


def flops_per_token(m, seq_len: int) -> float:
    """Training FLOPs per token: 3x the forward (forward + backward), matmuls only.

    Forward: 2 FLOPs per multiply-add of every weight matrix a token passes
    through (all projections, the MLP and the LM head; the input embedding is
    a lookup), plus attention's QK^T and AV, 2*2*T*H*D per token per layer,
    counted at half for the causal mask. Eq. 2 (cross_layer) attends over
    twice the keys in layers >= 2.
    """
    shapes = param_shapes(m)
    matmul = 0
    for path, x in jax.tree_util.tree_leaves_with_path(shapes):
        if getattr(path[-1], "key", None) == "kernel":
            matmul += int(np.prod(x.shape))
    if m.tie_embeddings:
        matmul += m.vocab_size * m.d_model  # the LM head is the input embedding, transposed
    return 3.0 * (2.0 * matmul) + attention_flops_per_token(m, seq_len)


def attention_flops_per_token(m, seq_len: int) -> float:
    """Of flops_per_token: attention's QK^T and AV, 2*2*T*H*D a token a layer, at half for the causal mask,
    forward and backward."""
    attn_layers = m.num_layers + (m.num_layers - 1 if m.mapping == "cross_layer" else 0)
    return 3.0 * attn_layers * 2 * 2 * seq_len * m.num_heads * m.head_dim * 0.5


def packed_documents(T: int, mean_len: float, rows: int = 64, seed: int = 0) -> np.ndarray:
    """[rows, T] int32, 1 at each document's last token: documents of geometric lengths with mean `mean_len`
    packed end to end, as a prepared corpus's rows look to a document mask (bench train --documents, compile
    --documents)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, T), np.int32)
    for row in out:
        ends = np.cumsum(rng.geometric(1 / mean_len, T)) - 1
        row[ends[ends < T]] = 1
    return out


def model_flops(m, seq_len: int) -> ModelFlops:
    pc = param_counts(m)
    total, non_embedding = pc["params_total"], pc["params_non_embedding"]
    per_token, attention = flops_per_token(m, seq_len), attention_flops_per_token(m, seq_len)
    return ModelFlops(total, non_embedding, per_token, 6.0 * non_embedding, attention)


def mfu(flops: ModelFlops, tokens_per_s: float, peak: float) -> dict[str, float]:
    """Model FLOPs utilisation in both conventions."""
    return {"mfu_6n": flops.per_token_6n * tokens_per_s / peak, "mfu_model": flops.per_token * tokens_per_s / peak}


def fsdp_devices(cfg, devices: int) -> int:
    """The devices the state is sharded over (config.mesh.fsdp; -1 or 0: all of them)."""
    if cfg.mesh.fsdp > 0:
        return cfg.mesh.fsdp
    return max(1, devices // (context_devices(cfg) * max(1, cfg.mesh.data)))


def context_devices(cfg) -> int:
    """The devices each sequence is split over (config.mesh.context)."""
    return max(1, cfg.mesh.context)


def step_time_floor(cfg: RunConfig) -> tuple[float, str]:
    """(seconds, how): the least time one optimizer step of `cfg` can take on this machine's devices: its FLOPs
    (flops_per_token x global_batch x seq_len) at their peak (datasheet, or on a CPU measured). nan where the peak is
    unknown."""
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "bfloat16"  # auto: the faster choice, a lower bound
    peak, _ = device_peak_flops(dtype)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    per_token = flops_per_token(cfg.model.replace(dtype=dtype), cfg.data.seq_len)
    return per_token * tokens / peak, (
        f"{per_token / 1e9:.2f} GFLOP a token x {tokens:,} tokens a step at this machine's peak of "
        f"{peak / 1e12:.3f} TFLOP/s"
    )


def say_hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} hours" if seconds >= 3600 else f"{seconds / 60:.0f} minutes"


def estimate_train_memory(cfg: RunConfig, devices: int, flash_attention: bool = True) -> dict:
    """An analytic estimate of one device's memory for a train step (bytes), for presets sized for hardware
    this machine does not have; the trainer's precheck measures the compiled step itself.

    Parameters and gradients in fp32 and the optimizer's state as its own init shapes it (`optimizer_state_bytes`:
    AdamW two fp32 moments a parameter, Muon one on its matrices), all sharded over fsdp; with
    remat=full each layer keeps only its input [micro-batch, T, E]; one layer's recomputation holds the
    q/k/v/out activations and the MLP's three [*, T, F] ones (x2 for their gradients); attention with a
    flash kernel keeps O(T) per head, without one the [H, T, T] fp32 matrix; the fused LM head keeps one
    fp32 block of logits. Against the compiled steps (docs/kernels-and-compile.md, `resformer compile`): 6-26%
    above XLA:GPU's numbers for the paper configs on 8x H100; TPU's compiler needs more memory for the same
    program, and sequences of 8K tokens and more need about 20% more than estimated.
    """
    m, t = cfg.model, cfg.train
    fsdp = max(1, fsdp_devices(cfg, devices))
    n_params = model_flops(m, cfg.data.seq_len).params_total
    act = jnp.dtype(m.dtype).itemsize
    context = context_devices(cfg)  # each sequence's tokens split over these devices; keys and values gathered
    mb = max(1, (t.microbatch or t.global_batch) // max(1, devices // context))
    S, E, F, H, L = cfg.data.seq_len, m.d_model, m.ffn_dim, m.num_heads, m.num_layers
    T = S // context  # the tokens a device holds
    state = (8 * n_params + optimizer_state_bytes(m, t)) / fsdp
    kept = L * mb * T * E * act if m.remat == "full" else L * mb * T * (6 * E + 3 * F) * act
    layer = 2 * mb * T * (4 * E + 3 * F) * act
    if context > 1:  # the gathered keys and values: one layer's (and their gradients), every layer's kept
        kv = 2 * mb * S * m.kv_heads * m.head_dim * act
        layer += 2 * kv
        kept += 0 if m.remat == "full" else L * kv
    attention = mb * H * T * 4 * 2 if flash_attention else mb * H * T * S * 4
    # one fp32 block of logits: its gradient reuses the buffer (compiled for H100, docs/kernels-and-compile.md)
    logits = mb * max(1, min(t.loss_chunk_len or T, T)) * m.vocab_size * 4
    total = state + kept + layer + attention + logits
    return {
        "state": int(state),
        "activations_kept": int(kept),
        "one_layer": int(layer),
        "attention": int(attention),
        "logits": int(logits),
        "total": int(total),
        "per_device_micro_batch": mb,
    }


@functools.cache
def optimizer_state_bytes(m, t) -> int:
    """The bytes of the optimizer's state for this model (ModelConfig `m`, TrainConfig `t`): its own `init` over the
    parameters' shapes (jax.eval_shape, nothing allocated), so any optimizer counts as it keeps its state."""
    state = jax.eval_shape(make_optimizer(t).init, param_shapes(m))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """XLA's per-device estimate for a compiled step."""

    arguments: int
    outputs: int
    temporaries: int
    aliased: int  # donated arguments reused as outputs

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temporaries - self.aliased


def step_memory(compiled) -> StepMemory | None:
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    return StepMemory(ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.temp_size_in_bytes, ma.alias_size_in_bytes)


def summary(cfg) -> dict:
    """Parameter counts, training FLOPs per token, KV-cache bytes per token and the memory estimate per
    device, as `--mode=summary` prints them (allocates nothing). `cfg`: the run's typed config, or a ConfigDict
    as written (typed here: a config file's summary before any run)."""
    from resformer_jax.config import RunConfig

    cfg = RunConfig.of(cfg)
    f = model_flops(cfg.model, cfg.data.seq_len)
    out: dict[str, Any] = {
        "params_total": f.params_total,
        "params_non_embedding": f.params_non_embedding,
        "flops_per_token": f.per_token,
        "flops_per_token_6n": f.per_token_6n,
        "attention_flops_per_token": f.attention_per_token,
    }
    if cfg.data.document_mask:
        out["documents"] = (
            "attention counted over whole sequences: an upper bound; a run logs perf/attended_fraction (the causal "
            "pairs its packed documents keep) and counts its model MFU by it"
        )
    value_tables = param_counts(cfg.model).get("params_value_embeddings")
    if value_tables:  # model.value_embeddings: the tables apart (embeddings, not in params_non_embedding)
        out["params_value_embeddings"] = value_tables
    out["kv_cache_bytes_per_token"] = cache_bytes_per_token(cfg.model)
    out["seq_len"] = cfg.data.seq_len
    out["tokens_per_step"] = cfg.train.global_batch * cfg.data.seq_len
    devices = cfg.mesh.num_devices or max(1, cfg.mesh.data) * max(1, cfg.mesh.fsdp)
    sized_for = re.match(r"\s*(\d+)\s*x", cfg.mesh.target or "")
    if sized_for and not cfg.mesh.num_devices and -1 in (cfg.mesh.data, cfg.mesh.fsdp):
        devices = int(sized_for.group(1))  # "all devices" of the hardware the config is sized for ("8x H100 80GB")
    est = estimate_train_memory(cfg, devices)
    out["memory_estimate_per_device"] = {**est, "devices": devices, "target": cfg.mesh.target or None}
    if cfg.mesh.device_memory_limit_gb > 0:
        limit = cfg.mesh.device_memory_limit_gb * 2**30
        out["memory_estimate_per_device"].update(limit=int(limit), fits=est["total"] <= limit)
    out["model"] = cfg.model.to_dict()
    return out


def causal_attention_flops(batch: int, seq_len: int, heads: int, head_dim: int) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs of causal attention: QK^T and AV over half the T x T matrix, two
    FLOPs a multiply-add; the backward is 2.5x the forward (five matmuls)."""
    fwd = 2 * 2 * batch * heads * seq_len * seq_len * head_dim / 2
    return fwd, 3.5 * fwd
