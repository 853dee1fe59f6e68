"""GQA with one eighth of the KV heads (Fig. 10 right). 82M, as in the paper's ablations; ABLATION holds the fields a
tiny test applies."""

from resformer_jax.presets import apply_ablation, paper_config

ABLATION = {"value_residual": "none", "num_kv_heads": "EIGHTH"}


def get_config():
    return apply_ablation(paper_config("82m"), ABLATION)
