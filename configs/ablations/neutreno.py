"""NeuTRENO (Eq. 8), lambda 0.4. 82M, as in the paper's ablations; ABLATION holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "neutreno"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
