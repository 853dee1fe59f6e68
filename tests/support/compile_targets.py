"""What the compile tests share: whether the TPU and GPU compilers are installed (the `aot` extra), the custom-call
names of the kernels, the targets, and a small model with accelerator-like settings."""

import importlib.util

import pytest

from resformer_jax.presets import tiny_config

MISSING = [
    pkg
    for pkg, mod in (("jax[tpu]", "libtpu"), ("the CUDA plugin", "jax_cuda12_plugin"))
    if importlib.util.find_spec(mod) is None
]
needs_aot = pytest.mark.skipif(
    bool(MISSING),
    reason=f"needs {' and '.join(MISSING)}: pip install -e '.[aot]' "
    "(CI installs it); compiling for TPU/GPU is not possible without",
)

TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "tpu_custom_call"
TARGETS = {"cuda": "h100x8", "tpu": "v5e:2x2"}  # 8 H100s; a TPU topology of 4 chips


def accelerator_config(variant, platform):
    """A small model with accelerator-like settings: bf16, scanned layers, remat=full, GQA, head_dim 64, a mesh of
    data x fsdp over the target's devices; `auto` attention, which is the platform's kernel there."""
    c = tiny_config(variant)
    m = c.model
    m.d_model, m.num_heads, m.num_kv_heads, m.ffn_dim, m.num_layers, m.vocab_size = 256, 4, 2, 512, 3, 512
    m.max_seq_len, c.data.seq_len = 256, 256
    m.dtype, m.scan_layers, m.remat, m.attention_impl = "bfloat16", True, "full", "auto"
    c.train.global_batch, c.train.microbatch = 16, 8
    c.mesh.data, c.mesh.fsdp = 2, -1
    return c
