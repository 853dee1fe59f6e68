"""The recipes comparison at a size a 2-core CPU trains in about a minute a run: 6 layers, d_model 128, a 4,096-token
BPE vocabulary (so the hidden matrices Muon updates are most of the model, as at scale), 256-token sequences,
8 a step, 200 steps of warmup-stable-decay (410K tokens). Data: a corpus prepared with --tokenizer train:4096
--seq_len 256."""

from resformer_jax.presets import paper_config


def get_config():
    c = paper_config("2m", "none")
    m, t = c.model, c.train
    m.num_layers, m.num_heads, m.d_model, m.ffn_dim, m.vocab_size = 6, 4, 128, 448, 4096
    m.max_seq_len, m.dtype, m.remat = 256, "float32", "none"
    c.data.seq_len = 256
    t.global_batch, t.microbatch, t.steps, t.peak_lr = 8, 0, 200, 3e-3
    t.schedule, t.wsd_fractions, t.wsd_decay_shape = "wsd", (0.05, 0.75, 0.2), "1-sqrt"
    t.log_every, t.eval_every, t.eval_batches = 10, 100, 4
    c.checkpoint.every_steps = 200
    c.mesh.num_devices = 1
    return c
