"""ResFormer with the convex lambda plus modded-nanogpt's value embeddings: two U-Net pairs of per-token tables added
to the own values of layers 1, 2 and L-1, L (a V_n + b VE, two learnable scalars a layer). 82M (paper Table 4's
shape); ABLATION holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "resformer", "resformer_lambdas": "convex", "value_embeddings": 2, "scan_layers": False}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
