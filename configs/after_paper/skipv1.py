"""SkipV1Former (Wu et al., arXiv 2510.16807): from layer 2 on, the last half of each layer's value heads are layer
1's; about half the value projections and 25% less KV cache. 82M (paper Table 4's shape); ABLATION holds the fields
a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "skipv1"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
