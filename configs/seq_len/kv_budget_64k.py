"""Paper Fig. 10 at 64K tokens a sequence: the equal-KV-budget comparisons at the long length.

--config=configs/seq_len/kv_budget_64k.py:NAME     NAME one of
  none            vanilla (the baseline)
  svformer        about 1/2 of vanilla's KV cache        gqa_half, cla2: the same budget
  svformer_gqa    SVFormer + GQA with 1/4 of the KV heads: about 1/8   gqa_eighth, cla2_gqa (CLA2 + GQA with
                  1/4 of the KV heads): the same budget (Fig. 10 right)
"""

from resformer_jax.presets import apply_ablation, seq_len_config

PRESETS = {
    "none": ("none", {}),
    "svformer": ("svformer", {}),
    "gqa_half": ("none", {"num_kv_heads": "HALF"}),
    "cla2": ("none", {"cla_share_every": 2}),
    "svformer_gqa": ("svformer", {"num_kv_heads": "QUARTER"}),
    "gqa_eighth": ("none", {"num_kv_heads": "EIGHTH"}),
    "cla2_gqa": ("none", {"cla_share_every": 2, "num_kv_heads": "QUARTER"}),
}


def get_config(name: str = "svformer"):
    variant, fields = PRESETS[name]
    return apply_ablation(seq_len_config("82m", variant, 65536), fields)
