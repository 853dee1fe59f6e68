"""ResFormer with learnable per-layer lambdas. 82M, as in the paper's ablations; ABLATION holds the fields a tiny test
applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "resformer_lambdas": "learnable"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
