"""ResFormer sparse: l1 = 5 on the last three layers only. 82M, as in the paper's ablations; ABLATION holds the fields
a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {
    "value_residual": "resformer",
    "resformer_lambdas": "sparse",
    "sparse_layers": "LAST3",
    "sparse_lambda": 5.0,
}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
