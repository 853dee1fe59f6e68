"""Paper Fig. 12 c/d: the 82M model with the GPT-2 architecture (LayerNorm, GELU MLP, learned absolute positions,
biases), any value-residual mode.

  --config=configs/gpt2_82m.py:VARIANT       VARIANT: none | resformer | svformer | neutreno | resformer+neutreno

As the authors' GPT-2 run and paper Table 4: untied embeddings (77.75M parameters, their "78M"; the tied form,
52.0M, with --config.model.tie_embeddings=True) and GPT-2's scaled init of the output projections (std
0.02/sqrt(2L), Hugging Face GPT2Config's default, which their run keeps). Dropout 0, as the paper's text says
(their run kept GPT2Config's 0.1: --config.model.dropout=0.1 reproduces that; it drops embeddings and residual
branches, not attention probabilities).
"""

from resformer_jax.presets import paper_config


def get_config(variant: str = "svformer"):
    c = paper_config("82m", variant)
    c.model.arch = "gpt2"
    c.model.ffn_dim = 4 * c.model.d_model  # GPT-2's MLP width
    c.model.tie_embeddings = False  # Table 4
    c.model.scaled_output_init = True  # GPT-2 / GPT2Config
    c.model.dropout = 0.0  # the paper's text
    return c
