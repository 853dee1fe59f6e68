"""The decode engine: requests of any length decoded together, continuously batched over a paged KV cache.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from resformer_jax.engine.engine import Engine, Request, SamplingParams
from resformer_jax.engine.errors import EngineError

__all__ = ["Engine", "EngineError", "Request", "SamplingParams"]
