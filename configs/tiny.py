"""A tiny model for tests and quick experiments (synthetic data by default)."""

from resformer_jax.presets import tiny_config


def get_config():
    return tiny_config("resformer")
