"""The tiny run the evaluation tests train: a ResFormer on the demo corpus, which carries a tokenizer, so the
run can be scored on text (zero-shot tasks, lm-eval, generation from a prompt)."""

from resformer_jax.presets import tiny_config


def tokenized_tiny_config(steps: int = 10):
    """tiny.py's ResFormer on the demo corpus: vocabulary 1,024, 64-token sequences, a 256-token context."""
    c = tiny_config("resformer")
    c.data.source, c.model.vocab_size, c.data.seq_len, c.model.max_seq_len = "demo", 1024, 64, 256
    c.train.steps, c.train.eval_every, c.mesh.num_devices = steps, 1000, 1
    return c
