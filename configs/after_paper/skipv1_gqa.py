"""SkipV1Former with GQA (4 key/value heads for 8 query heads; 2 of them from layer 1). 82M (paper Table 4's shape);
ABLATION holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "skipv1", "num_kv_heads": 4}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
