"""The embedded demo: a tiny ResFormer on the Python standard library's source, offline.

python -m resformer_jax.main          # finishes in a few minutes on 2 CPU cores
"""

from resformer_jax.config import base_config


def get_config():
    c = base_config()
    m = c.model
    m.vocab_size = 1024  # the demo's byte-level BPE (data/demo.py)
    m.num_layers = 4
    m.num_heads = 4
    m.d_model = 128
    m.ffn_dim = 384
    m.max_seq_len = 256
    m.value_residual = "resformer"
    m.dtype = "auto"  # bf16 where this CPU multiplies faster in bf16 (measured and printed at start), else fp32
    m.attention_impl = "auto"
    c.data.source = "demo"
    c.data.seq_len = 128
    t = c.train
    t.global_batch = 16
    t.steps = 300
    t.warmup_steps = 30
    t.peak_lr = 3e-3
    t.log_every = 25
    t.eval_every = 100
    t.eval_batches = 4
    c.checkpoint.every_steps = 100
    return c
