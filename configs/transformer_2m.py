"""Paper Table 4, 2m: transformer."""

from resformer_jax.presets import paper_config


def get_config():
    return paper_config("2m", "none")
