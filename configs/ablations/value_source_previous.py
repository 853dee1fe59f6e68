"""Fig. 8: residual from the previous layer's value. 82M, as in the paper's ablations; ABLATION holds the fields a tiny
test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "value_source": "previous"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
