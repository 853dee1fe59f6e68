"""Fig. 14: SVFormer whose shared value is recomputed at the middle layer. 82M, as in the paper's ablations; ABLATION
holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "svformer", "svformer_anchors": "MIDDLE"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
