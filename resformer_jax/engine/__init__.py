"""The decode engine: requests of any length decoded together, continuously batched over a paged KV cache.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from resformer_jax.engine.engine import Engine, Finished, FinishReason, NewToken, Output, Request
from resformer_jax.engine.errors import EngineError
from resformer_jax.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineError", "FinishReason", "Finished", "NewToken", "Output", "Request", "SamplingParams"]
