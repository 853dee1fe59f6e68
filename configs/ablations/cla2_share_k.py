"""Fig. 4: only keys shared every two layers. 82M, as in the paper's ablations; ABLATION holds the fields a tiny test
applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "none", "cla_share_every": 2, "cla_share": "k"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
