"""ResFormer with the convex single lambda of modded-nanogpt's 2024-11-06 record: V = (1 - l) V_n + l V_1, one
learnable l a layer, initialised to 0.5. 82M (paper Table 4's shape); ABLATION holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "resformer_lambdas": "convex"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
