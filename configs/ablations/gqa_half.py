"""GQA with half the KV heads: the KV budget of SVFormer (Fig. 10 left). 82M, as in the paper's ablations; ABLATION
holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "none", "num_kv_heads": "HALF"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
