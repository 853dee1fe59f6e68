"""Vanilla with gated value embeddings (modded-nanogpt's later form): V_n + 2 sigmoid(x W) VE per value head and token,
two U-Net pairs. 82M (paper Table 4's shape); ABLATION holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "none", "value_embeddings": 2, "value_embedding_gate": True, "scan_layers": False}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
