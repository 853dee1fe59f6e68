"""The architecture: knows nothing of training, data or files. `model.config` (the typed config) imports no JAX,
so the run's config can be read without it; `Transformer` is imported on first use.

Tensors are named with their shapes (`q_BxTxHxD`), in these letters everywhere in model/ and kernels/:
  B batch            T query positions       S key positions (the cache in decoding)
  E d_model          H query heads           K key/value heads (GQA: K divides H)      D head_dim
  F ffn_dim          V vocabulary            N tokens of a flattened batch (B*T)      L stacked layers (2..num_layers)
  I, O a projection's input and output width; C a block of query positions (chunked attention)
"""


def __getattr__(name: str):
    if name == "Transformer":
        from resformer_jax.model.transformer import Transformer

        return Transformer
    raise AttributeError(f"module 'resformer_jax.model' has no attribute {name!r}")
