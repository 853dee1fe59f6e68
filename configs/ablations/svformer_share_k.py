"""Fig. 13: share the first layer's keys instead of values. 82M, as in the paper's ablations; ABLATION holds the fields
a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "svformer", "svformer_share": "k"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
