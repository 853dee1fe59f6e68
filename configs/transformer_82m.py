"""Paper Table 4, 82m: transformer.

Sized for 8x H100 80GB by `resformer compile --tune --target=h100x8` (the best roofline bound that
fits with 10% to spare): layers unrolled, remat=none, the step's 1,024 sequences in one pass (128 a GPU).
On other hardware run --tune for it, or set train.microbatch (the precheck says what fits).
"""

from resformer_jax.presets import paper_config


def get_config():
    return paper_config("82m", "none")
