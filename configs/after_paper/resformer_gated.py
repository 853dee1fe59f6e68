"""ResFormer with lucidrains/x-transformers' learned value-residual mix: V = (1 - g) V_n + g V_1, g = sigmoid(x W_g)
per value head and token, W_g zero-initialised (g = 1/2). 82M (paper Table 4's shape); ABLATION holds the fields a
tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "resformer_lambdas": "gated"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
