"""Scale-out preset, 1b: svformer, OLMo-1B's shapes (presets.py SCALE_MODELS, docs/scaling-out.md).

  --config=configs/svformer_1b.py[:CLUSTER]     CLUSTER: h100x8 (default), 4xh100x8, v5p-128, v6e-64

Each cluster's mesh, microbatch and remat were chosen by `resformer compile` for that cluster; the table in
docs/scaling-out.md gives the memory, the step-time bound and the days to the token budget (20 tokens a parameter).
"""

from resformer_jax.presets import scale_config


def get_config(cluster: str = "h100x8"):
    return scale_config("1b", "svformer", cluster)
