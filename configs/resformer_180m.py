"""Paper Table 4, 180m: resformer."""

from resformer_jax.config import paper_config


def get_config():
    return paper_config("180m", "resformer")
