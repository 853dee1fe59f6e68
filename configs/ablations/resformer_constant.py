"""ResFormer with the paper's constant lambdas (2, 1). 82M, as in the paper's ablations; ABLATION holds the fields a
tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "lambda_init": (2.0, 1.0)}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
