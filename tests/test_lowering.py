"""Every step the project compiles also lowers for its accelerators, from this CPU machine (issue 16).

`jax.export` lowers a jitted function for platforms that are not present. What it checks: tracing,
sharding propagation over a data x fsdp mesh of 8 devices (CPU devices stand in for 8 accelerators),
and each op's lowering rule for the target, including the Pallas kernels' own lowerings (Triton for
CUDA, Mosaic for TPU), which run in the exported module as custom calls. What it cannot check here:
XLA's backend compilation (the GPU/TPU compilers are not in a CPU jaxlib) and Triton's own
compilation to PTX, where register and shared-memory limits are finally enforced;
`python -m resformer_jax.bench accelerator` does those on a real device.
"""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from resformer_jax import kernels
from resformer_jax.config import tiny_config
from resformer_jax.kernels.pallas_attention import flash_attention
from resformer_jax.kernels.tpu_attention import splash_attention
from resformer_jax.model.decode import FrozenModelConfig, _step, cache_shapes
from resformer_jax.train.setup import build

# The Triton kernel's custom call carries no cross-version compatibility guarantee, so jax.export
# refuses to serialise it unless told to; lowering (what these tests check) is unaffected.
CHECKS = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
KERNEL_CALL = {"cuda": "xla.gpu.triton", "tpu": "tpu_custom_call"}
KERNEL_IMPL = {"cuda": "pallas", "tpu": "splash"}


def lowered(fn, platform, *args, **kwargs) -> str:
    """The StableHLO of `fn` lowered for `platform`, through jax.export (what a deployment serialises);
    where export's own bookkeeping fails, through the same lowering it calls (trace().lower())."""
    try:
        exp = export.export(fn, platforms=(platform,), disabled_checks=CHECKS)(*args, **kwargs)
        assert exp.platforms == (platform,)
        return exp.mlir_module()
    except ValueError as e:
        if "Too many leaves for PyTreeDef" not in str(e):  # jax.export's DCE bookkeeping with Mosaic calls
            raise
        return fn.trace(*args, **kwargs).lower(lowering_platforms=(platform,)).as_text()


def accelerator_config(variant, platform):
    """A small model with accelerator-like settings: bf16, scanned layers, remat=full, GQA, head_dim 64."""
    c = tiny_config(variant)
    m = c.model
    m.d_model, m.num_heads, m.num_kv_heads, m.ffn_dim, m.num_layers, m.vocab_size = 256, 4, 2, 512, 3, 512
    m.max_seq_len, c.data.seq_len = 256, 256
    m.dtype, m.scan_layers, m.remat = "bfloat16", True, "full"
    m.attention_impl = KERNEL_IMPL[platform]
    c.train.global_batch, c.train.microbatch = 16, 8
    c.mesh.data, c.mesh.fsdp = 2, 4
    return c


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("variant", ["none", "resformer", "svformer"])
def test_sharded_train_and_eval_steps_lower(platform, variant):
    c = accelerator_config(variant, platform)
    setup = build(c, log=lambda s: None)
    assert dict(setup.mesh.shape) == {"data": 2, "fsdp": 4}
    batch = jax.ShapeDtypeStruct(setup.global_batch_shape, jnp.int32, sharding=setup.batch_sh)
    text = lowered(setup.train_step, platform, setup.abstract_state, batch)
    # forward + backward of every layer's attention go through the platform's kernel
    assert text.count(KERNEL_CALL[platform]) >= 3, f"{platform}: the attention kernel is not in the lowered step"
    assert "mhlo.num_partitions = 8" in text or "num_partitions = 8" in text
    text = lowered(setup.eval_step, platform, setup.abstract_state.params, batch)
    assert KERNEL_CALL[platform] in text


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("variant", ["none", "svformer"])
def test_decode_step_lowers(platform, variant):
    c = accelerator_config(variant, platform)
    setup = build(c, log=lambda s: None)
    mf = FrozenModelConfig(setup.model_cfg)
    cache = cache_shapes(setup.model_cfg, batch=4, max_len=64)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), setup.abstract_state.params)
    for T in (16, 1):  # prefill and one token
        lowered(_step, platform, params, jax.ShapeDtypeStruct((4, T), jnp.int32), cache, m_frozen=mf, max_len=64)


SHAPES = [(2, 2048, 16, 4, 128), (2, 2048, 16, 16, 64), (2, 1000, 8, 2, 64)]  # B, T, H, K, D


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("platform,kernel", [("cuda", flash_attention), ("tpu", splash_attention)],
                         ids=["cuda-pallas", "tpu-splash"])
def test_attention_kernels_lower_at_realistic_shapes(platform, kernel, shape):
    """bf16, head_dim 64 and 128, T = 2,048, GQA, and a length (1,000) that is not a multiple of any block."""
    B, T, H, K, D = shape
    sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    fwd_bwd = jax.jit(jax.value_and_grad(lambda q, k, v: kernel(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    text = lowered(fwd_bwd, platform, sds(B, T, H, D), sds(B, T, K, D), sds(B, T, K, D))
    n = text.count(KERNEL_CALL[platform])
    assert n >= 2, f"{platform}: expected the kernel's forward and backward custom calls, found {n}"


def test_cudnn_cannot_lower_from_a_cpu_machine_and_says_why():
    """cuDNN attention asks the local CUDA runtime for the cuDNN version while tracing, so it cannot be
    lowered where no GPU is present; the project's guard says so. Checked instead above: the same steps
    with the Pallas (Triton) kernel and (below) with XLA's attention, lowered for `cuda`."""
    q = jnp.zeros((1, 16, 4, 16))
    with pytest.raises(kernels.KernelUnavailable, match="needs an NVIDIA GPU"):
        kernels.attention(q, q, q, impl="cudnn")


def test_xla_attention_step_lowers_for_cuda():
    c = accelerator_config("resformer", "cuda")
    c.model.attention_impl = "xla"
    setup = build(c, log=lambda s: None)
    batch = jax.ShapeDtypeStruct(setup.global_batch_shape, jnp.int32, sharding=setup.batch_sh)
    assert "xla.gpu.triton" not in lowered(setup.train_step, "cuda", setup.abstract_state, batch)


def test_auto_on_tpu_selects_jax_splash_kernel():
    """The probe with the backend injected as TPU tries JAX's splash kernel first (here it runs interpreted)."""
    msgs = []
    choice, rejected = kernels.probe_auto((1, 128, 4, 64), 2, jnp.float32, msgs.append, backend="tpu")
    assert choice == "splash", (choice, rejected)
    assert set(rejected) == {"pallas", "cudnn"} and "not a GPU" in rejected["pallas"]
    candidates, _ = kernels.auto_candidates("gpu")
    assert candidates[0] == "pallas" and "splash" not in candidates


def test_a_named_impl_that_cannot_run_raises_and_never_falls_back():
    c = tiny_config("resformer")
    c.model.attention_impl = "cudnn"
    from resformer_jax.train.setup import resolve_attention
    choice = resolve_attention(c)  # named: kept as it is, nothing probed
    assert choice.impl == "cudnn" and not choice.probed
    with pytest.raises(kernels.KernelUnavailable, match="cudnn"):
        build(c, log=lambda s: None)


def test_pallas_triton_blocks_fit_the_shared_memory_budget():
    from resformer_jax.kernels.pallas_attention import SMEM_BUDGET_BYTES, choose_blocks, smem_bytes
    for D, itemsize in ((64, 2), (128, 2), (64, 4), (128, 4), (256, 2)):
        bq, bk = choose_blocks(2048, 2048, D, itemsize)
        assert smem_bytes(bq, bk, D, itemsize) <= SMEM_BUDGET_BYTES and bq >= 16 and bk >= 16
    assert choose_blocks(2048, 2048, 64, 2) == (128, 128)
    assert functools.reduce(max, choose_blocks(2048, 2048, 128, 2)) < 128  # shrunk for head_dim 128
