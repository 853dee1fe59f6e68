"""CLA2 (Brandon et al. 2024): K and V shared by pairs of layers; half the KV cache. 82M, as in the paper's ablations;
ABLATION holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "none", "cla_share_every": 2}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
