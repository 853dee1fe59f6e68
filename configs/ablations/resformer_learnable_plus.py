"""ResFormer learnable-plus: l1 = scale * softmax(logits) over layers. 82M, as in the paper's ablations; ABLATION holds
the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "resformer_lambdas": "learnable_plus"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
