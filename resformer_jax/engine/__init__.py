"""The decode engine: requests of any length decoded together, continuously batched over a paged KV cache.

Above `model/` and `kernels/`, below the commands: `generate`, the lm-eval adapter's `generate_until`, `bench
decode` and the server all decode through `Engine`. A cache page holds, for `page_size` tokens, exactly what each
layer's equation reads (model/attention.py): K and V a layer for vanilla and ResFormer (its mixed V), K a layer plus
V_1 once for SVFormer, the own heads for SkipV1Former, `num_kv_heads` heads under GQA.

  pages.py     the page pool (host side) and the cache's size from a memory budget
  sampling.py  per-row sampling inside the compiled step (temperature, top-k, top-p, a seed a request)
  engine.py    requests, the scheduler (chunked prefill interleaved with decoding, preemption, prefix sharing)
  runner.py    the compiled half: the serving model and parameters, the cache pools, the step programs
"""

from resformer_jax.engine.engine import Engine, Request, SamplingParams
from resformer_jax.engine.pages import EngineError

__all__ = ["Engine", "EngineError", "Request", "SamplingParams"]
