"""Paper Table 4, 468m: transformer."""

from resformer_jax.config import paper_config


def get_config():
    return paper_config("468m", "none")
