"""Paper Table 4, 82m: resformer."""

from resformer_jax.config import paper_config


def get_config():
    return paper_config("82m", "resformer")
