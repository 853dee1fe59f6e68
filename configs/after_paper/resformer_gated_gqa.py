"""The gated mix with GQA (2 key/value heads for 8 query heads): one gate per key/value head and token. 82M (paper
Table 4's shape); ABLATION holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "resformer_lambdas": "gated", "num_kv_heads": 2}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
