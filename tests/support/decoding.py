"""The decode checks several rooms share: the engine's paged steps against the cache-free forward, and the bytes of
the engine's cache pools."""

import jax
import jax.numpy as jnp
import numpy as np
from reference import init_params

from resformer_jax.config import validate
from resformer_jax.engine import Engine, SamplingParams
from resformer_jax.model import Transformer
from resformer_jax.model.attention import PageLayout
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.transformer import pool_shapes
from resformer_jax.resolve import for_backend


def assert_decode_equals_forward(c):
    """The engine's paged steps (a 12-token prompt in chunks of 5 over pages of 4, then 6 tokens, 4 decode steps a
    program) give the cache-free full forward's log-probabilities at every position, prompt and generated, and each
    generated token is the forward's most likely (within round-off: a random init's logits are nearly flat)."""
    validate(c)
    m = for_backend(ModelConfig.of(c.model))
    model = Transformer(m)
    toks = jax.random.randint(jax.random.PRNGKey(0), (1, 12), 0, c.model.vocab_size)
    p = init_params(model, toks, seed=1)
    engine = Engine(m, p, cache_bytes=2**22, page_size=4, max_batch=2, prefill_chunk=5, decode_steps=4)
    (r,) = engine.generate([toks[0].tolist()], SamplingParams(max_tokens=6, logprobs=1, prompt_logprobs=1))
    ids = toks[0].tolist() + r.tokens
    logp = np.asarray(jax.nn.log_softmax(jax.jit(model.apply)({"params": p}, jnp.array([ids]))[0], -1))
    want = [logp[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(r.scores.logprob[1:], want, atol=1e-4, rtol=1e-4)
    for i in range(12, len(ids)):
        assert logp[i - 1, ids[i]] >= logp[i - 1].max() - 1e-4, f"generated token {i - 12} is not the greedy one"
    return model, p


def pool_bytes(c, pages=3, page_size=40):
    """The engine's cache pools for `pages` pages of `page_size` tokens under config c: (bytes, the pools)."""
    pools = pool_shapes(
        Transformer(for_backend(ModelConfig.of(c.model)).replace(scan_layers=False), pages=PageLayout(pages, page_size))
    )
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(pools))), pools
