"""Fig. 8 variant: Eq. 7's mix of the mean of V_1..V_{n-1} with V_n, U_n = A_n (l1 mean(V_1..V_{n-1}) + l2 V_n). 82M,
as in the paper's ablations; ABLATION holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "value_source": "mean_of_previous_mixed"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
