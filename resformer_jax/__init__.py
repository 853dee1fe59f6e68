"""resformer_jax: pretraining value-residual transformers (ResFormer, SVFormer) in JAX/Flax."""
__version__ = "0.1.0"
