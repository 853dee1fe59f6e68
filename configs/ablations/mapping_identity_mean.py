"""Eq. 6 as the paper writes it: U_n = A_n V_n + (1/(n-1)) sum_{i<n} V_i. 82M, as in the paper's ablations; ABLATION
holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "mapping": "identity", "value_source": "mean_of_previous"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
