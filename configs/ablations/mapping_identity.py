"""Fig. 7: identity mapping, U_n = A_n V_n + V_1 (ResFormer with only the mapping changed; Eq. 6 with m = 1). 82M, as
in the paper's ablations; ABLATION holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "mapping": "identity"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
