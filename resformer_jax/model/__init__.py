"""The architecture: knows nothing of training, data or files. `model.config` (the typed config) imports no JAX,
so the run's config can be read without it; `Transformer` is imported on first use."""


def __getattr__(name: str):
    if name == "Transformer":
        from resformer_jax.model.transformer import Transformer

        return Transformer
    raise AttributeError(f"module 'resformer_jax.model' has no attribute {name!r}")
