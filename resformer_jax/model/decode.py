"""KV cache and generation.

The cache lives in the flax `cache` collection, preallocated at `max_len` and
updated in place with `lax.dynamic_update_slice` inside a jitted step. What a
layer caches is what its equation needs: K for every layer that owns keys, V
for every layer that owns values (SVFormer: layer 1 only), so the bytes
reported by `kv_cache_bytes` are read off the arrays themselves.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from resformer_jax.model.config import ModelConfig
from resformer_jax.model.transformer import Transformer


def decode_model(m, max_len: int) -> Transformer:
    return Transformer(m, decode=True, max_len=max_len)


def cache_shapes(m, batch: int, max_len: int):
    """Shapes/dtypes of the cache collection, without allocating anything."""
    model = decode_model(m, max_len)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((batch, 1), jnp.int32)))
    return shapes["cache"]


def kv_bytes(cache) -> int:
    """Bytes held by K/V arrays of a cache (the scalar write index excluded)."""
    leaves = jax.tree_util.tree_leaves_with_path(cache)
    return int(
        sum(
            np.prod(x.shape) * jnp.dtype(x.dtype).itemsize
            for p, x in leaves
            if getattr(p[-1], "key", None) in ("k", "v")
        )
    )


def kv_cache_bytes_per_token(m) -> int:
    """What an inference cache must hold per token, summed over layers."""
    return kv_bytes(cache_shapes(m, batch=1, max_len=1))


def init_cache(m, params, batch: int, max_len: int):
    model = decode_model(m, max_len)
    variables = jax.jit(lambda p: model.init(jax.random.PRNGKey(0), jnp.zeros((batch, 1), jnp.int32)))(params)
    return jax.tree.map(jnp.zeros_like, variables["cache"])


@functools.partial(jax.jit, static_argnames=("m_frozen", "max_len"), donate_argnums=(2,))
def _step(params, tokens_BxT, cache, *, m_frozen, max_len):
    model = decode_model(m_frozen, max_len)
    logits, mutated = model.apply({"params": params, "cache": cache}, tokens_BxT, mutable=["cache"])
    return logits, mutated["cache"]


# Prompt tokens one prefill call takes. The cache's attention is plain XLA over the whole cache, so a call holds
# [heads, tokens, max_len] fp32 scores: a 64K prompt in one call needs 270 GiB on a GPU (compiled for
# H100), in chunks of 2,048 a few GiB. Chunks attend to the cache written by the earlier ones (the cache's
# index advances), so the result is the one-call prefill's.
PREFILL_CHUNK = 2048


def prefill(params, prompt_BxP, cache, *, m_frozen, max_len, chunk: int = PREFILL_CHUNK):
    """The prompt through the model in chunks of `chunk` tokens; (the last chunk's logits, the cache)."""
    P = prompt_BxP.shape[1]
    for start in range(0, P, chunk):
        logits, cache = _step(params, prompt_BxP[:, start : start + chunk], cache, m_frozen=m_frozen, max_len=max_len)
    return logits, cache


def sample_logits(logits_BxV, rng, temperature: float, top_k: int, top_p: float):
    """Greedy at temperature 0; otherwise temperature, top-k and nucleus (top-p) sampling."""
    if temperature <= 0:
        return jnp.argmax(logits_BxV, axis=-1)
    logits = logits_BxV / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if 0 < top_p < 1:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1)


def cache_shardings(cache, mesh, batch: int, kv_axes=None):
    """Cache arrays [.., B, max_len, K, D] sharded like the batch ((data, fsdp)) and the kv heads.

    Scanned layers' caches carry a leading layer axis. A batch that does not divide over the
    mesh is replicated instead.
    """

    n = mesh.shape["data"] * mesh.shape["fsdp"]
    b_axes = ("data", "fsdp") if batch % n == 0 else None

    def spec(x):
        if x.ndim < 4:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, P(*([None] * (x.ndim - 4)), b_axes, None, kv_axes, None))

    return jax.tree.map(spec, cache)


def generate(
    m,
    params,
    prompt_BxP,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    max_len: int | None = None,
    eos_id: int | None = None,
    mesh=None,
    param_shardings=None,
):
    """Prefills the prompts (equal length) and decodes token by token.

    With a mesh, parameters take `param_shardings` (the training layout) and the cache is
    sharded over the batch like the training batch. Returns (tokens [B, P + new], stats)
    where stats has the cache bytes allocated.
    """
    prompt_BxP = jnp.asarray(prompt_BxP, jnp.int32)
    B, P = prompt_BxP.shape
    max_len = max_len or (P + max_new_tokens)
    if P + max_new_tokens > max_len:
        raise ValueError(f"prompt ({P}) + max_new_tokens ({max_new_tokens}) exceeds max_len={max_len}")
    mf: ModelConfig = m  # hashable: a static jit argument
    cache = init_cache(mf, params, B, max_len)
    if mesh is not None:
        cache = jax.device_put(cache, cache_shardings(cache, mesh, B))
        if param_shardings is not None:
            params = jax.device_put(params, param_shardings)
    cache_bytes = kv_bytes(cache)
    logits, cache = prefill(params, prompt_BxP, cache, m_frozen=mf, max_len=max_len)
    rng = jax.random.PRNGKey(seed)
    out = [prompt_BxP]
    done = jnp.zeros((B,), bool)
    t0 = time.perf_counter()
    for i in range(max_new_tokens):
        rng, sub = jax.random.split(rng)
        nxt = sample_logits(logits[:, -1], sub, temperature, top_k, top_p).astype(jnp.int32)
        if eos_id is not None:
            nxt = jnp.where(done, eos_id, nxt)
            done = done | (nxt == eos_id)
        out.append(nxt[:, None])
        # Asking the host whether every row is done forces a sync; do it every 16 tokens only,
        # so the decode steps in between are dispatched back to back.
        if eos_id is not None and i % 16 == 15 and bool(done.all()):
            break
        logits, cache = _step(params, nxt[:, None], cache, m_frozen=mf, max_len=max_len)
    tokens = jnp.concatenate(out, axis=1)
    jax.block_until_ready(tokens)
    dt = time.perf_counter() - t0
    n_new = tokens.shape[1] - P
    return tokens, {
        "kv_cache_bytes": cache_bytes,
        "decode_tokens_per_s": B * n_new / max(dt, 1e-9),
        "new_tokens": n_new,
    }
