"""The architecture: knows nothing of training, data or files."""
from resformer_jax.model.transformer import Transformer  # noqa: F401
