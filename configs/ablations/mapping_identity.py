"""Fig. 7 / Eq. 6: A_n V_n + mean of earlier values. 82M, as in the paper's ablations; ABLATION holds the fields a tiny test applies."""
from resformer_jax.config import apply_ablation, paper_config

ABLATION = {'value_residual': 'resformer', 'mapping': 'identity', 'value_source': 'mean_of_previous'}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
