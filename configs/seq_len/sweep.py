"""Paper Table 3 / Fig. 11: one run of the sequence-length sweep, 2M tokens a step.

  --config=configs/seq_len/sweep.py:VARIANT,SEQ_LEN[,SIZE]      e.g. configs/seq_len/sweep.py:svformer,65536
  python -m resformer_jax.sweep --config=configs/seq_len/sweep.py:svformer,2048 --workdir=runs/seqlen \\
      --set data.seq_len=...   (or one workdir per preset; compare with --vs data.seq_len)

SEQ_LEN is one of 512, 2048, 8192, 32768, 65536; SIZE defaults to 82m. Sized for 8x H100 80GB
(--mode=summary reports the tokens per step and the memory estimate against it).
"""

from resformer_jax.presets import seq_len_config


def get_config(arg: str = "svformer,2048"):
    parts = arg.split(",")
    variant, seq_len = parts[0], int(parts[1])
    size = parts[2] if len(parts) > 2 else "82m"
    return seq_len_config(size, variant, seq_len)
