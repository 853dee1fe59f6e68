"""The attention implementations by name: the one list the config validates against."""

# auto: resolved once at setup by probing at the run's shapes (train/setup.py).
# pallas: this project's flash attention (GPU, Triton); splash: JAX's TPU splash-attention kernel.
IMPLS = ("auto", "pallas", "cudnn", "splash", "chunked", "xla", "reference")
