"""Paper Table 4, 180m: svformer.

Sized for 8x H100 80GB by `resformer compile --tune --target=h100x8` (the best roofline bound that
fits with 10% to spare): layers unrolled, remat=none, 64 sequences a GPU a microbatch (2 accumulation steps).
On other hardware run --tune for it, or set train.microbatch (the precheck says what fits).
"""

from resformer_jax.presets import paper_config


def get_config():
    return paper_config("180m", "svformer")
