"""Fig. 7 / Eq. 2: exact cross-layer attention over layer n and layer 1. 82M, as in the paper's ablations; ABLATION
holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "mapping": "cross_layer"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
