"""Fig. 8 / Eq. 5: U_n = (1/n) A_n sum_{i<=n} V_i, the mean of all values up to layer n. 82M, as in the paper's
ablations; ABLATION holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "value_source": "mean_of_previous"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
