"""SVFormer + GQA with a quarter of the KV heads: about 1/8 of vanilla's KV cache. 82M, as in the paper's ablations;
ABLATION holds the fields a tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "svformer", "num_kv_heads": "QUARTER"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
