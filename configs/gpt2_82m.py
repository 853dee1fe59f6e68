"""Paper Fig. 12 c/d: the 82M model with the GPT-2 architecture (LayerNorm, GELU MLP, learned absolute positions,
tied embeddings, biases), any value-residual mode.

  --config=configs/gpt2_82m.py:VARIANT       VARIANT: none | resformer | svformer | neutreno | resformer+neutreno
"""
from resformer_jax.config import paper_config


def get_config(variant: str = "svformer"):
    c = paper_config("82m", variant)
    c.model.arch = "gpt2"
    c.model.ffn_dim = 4 * c.model.d_model  # GPT-2's MLP width
    return c
