"""Sequences longer than one GPU holds: each sequence split over the 8 GPUs of one node (context parallelism,
mesh.context=8; the Pallas kernel on each GPU's two slices of it), 2M tokens a step as Table 3.

  --config=configs/seq_len/context.py:VARIANT,SEQ_LEN[,SIZE]     e.g. configs/seq_len/context.py:svformer,131072
  resformer compile --config=configs/seq_len/context.py:svformer,65536 --target=h100x8

SEQ_LEN is one of 32768, 65536, 131072; SIZE defaults to 468m. Sized for 8x H100 80GB by `resformer compile`
(docs/scaling-out.md has its memory and bound): remat none at 32K, full above.
"""

from resformer_jax.config import ConfigError
from resformer_jax.presets import paper_config

LENGTHS = (32768, 65536, 131072)


def get_config(arg: str = "svformer,32768"):
    parts = arg.split(",")
    variant, seq_len = parts[0], int(parts[1])
    size = parts[2] if len(parts) > 2 else "468m"
    if seq_len not in LENGTHS:
        raise ConfigError(
            f"seq_len {seq_len} is not one of {LENGTHS}; shorter sequences fit a GPU: configs/seq_len/sweep.py"
        )
    c = paper_config(size, variant)
    c.data.seq_len = c.model.max_seq_len = seq_len
    c.train.global_batch, c.train.microbatch = 2**21 // seq_len, 1  # a microbatch: one sequence over the 8 GPUs
    c.model.remat, c.model.scan_layers = ("none" if seq_len <= 32768 else "full"), False
    c.mesh.num_devices, c.mesh.data, c.mesh.fsdp, c.mesh.context = 8, 1, 1, 8
    c.mesh.device_memory_limit_gb, c.mesh.target = 80.0, "8x H100 80GB"
    return c
