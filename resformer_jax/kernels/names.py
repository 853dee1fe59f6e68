"""The attention implementations by name: the one list the config validates against."""

# auto: resolved once at setup by probing at the run's shapes (train/setup.py).
IMPLS = ("auto", "pallas", "cudnn", "chunked", "xla", "reference")
