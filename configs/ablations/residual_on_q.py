"""Fig. 6: residual on queries instead of values. 82M, as in the paper's ablations; ABLATION holds the fields a tiny
test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "residual_on": "q"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
