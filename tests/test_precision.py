"""bf16 compute on CPU (issue 21): the fast paths equal the plain ones.

The bf16 matmuls take fp32 accumulation and canonical layouts (model/layers.py `mixed_matmul`, `transposed`;
train/loss.py); fp32 keeps its exact old code path (tests/test_structure.py pins its losses bitwise).
"""
import jax
import jax.numpy as jnp
import numpy as np

from resformer_jax.config import tiny_config
from resformer_jax.model import Transformer
from resformer_jax.model.layers import mixed_matmul, swiglu_low_precision, transposed
from resformer_jax.train.loss import chunked_cross_entropy, cross_entropy
from resformer_jax.train.step import loss_fn


def test_transposed_is_the_transpose_bitwise():
    x = jax.random.normal(jax.random.PRNGKey(0), (37, 11), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(jax.jit(transposed)(x)), np.asarray(x.T))


def test_mixed_matmul_value_and_gradients_against_autodiff_of_the_plain_product():
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(kx, (64, 48), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (48, 40), jnp.float32)
    g = jax.random.normal(kg, (64, 40), jnp.float32)
    # The reference: the same rounded operands, everything else in fp32 (what the bf16 path approximates).
    ref = lambda x, w: jnp.dot(x.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    y, vjp = jax.vjp(mixed_matmul, x, w)
    y_ref, vjp_ref = jax.vjp(ref, x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-5)  # fp32 accumulation
    dx, dw = jax.jit(vjp)(g)
    dx_ref, dw_ref = vjp_ref(g)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32  # the parameter's gradient never rounded to bf16
    # bf16 cotangent rounding: relative error about 2^-8 of each product's magnitude
    scale_x = np.abs(np.asarray(g)) @ np.abs(np.asarray(w)).T
    np.testing.assert_array_less(np.abs(np.asarray(dx, np.float32) - np.asarray(dx_ref, np.float32)), 1e-2 * scale_x + 1e-3)
    scale_w = np.abs(np.asarray(x, np.float32)).T @ np.abs(np.asarray(g))
    np.testing.assert_array_less(np.abs(np.asarray(dw) - np.asarray(dw_ref)), 1e-2 * scale_w + 1e-3)


def test_swiglu_low_precision_against_autodiff_of_silu_times_up_in_fp32():
    """The bf16 SwiGLU activation (fp32 inside, saves only gate and up) against jax's own silu(g) * u in fp32 on
    the same rounded inputs: value and both gradients within one bf16 rounding of the result."""
    kg, ku, kd = jax.random.split(jax.random.PRNGKey(3), 3)
    g = (3 * jax.random.normal(kg, (64, 96), jnp.float32)).astype(jnp.bfloat16)
    u = jax.random.normal(ku, (64, 96), jnp.float32).astype(jnp.bfloat16)
    d = jax.random.normal(kd, (64, 96), jnp.float32).astype(jnp.bfloat16)
    ref = lambda g, u: jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)  # noqa: E731
    h, vjp = jax.vjp(swiglu_low_precision, g, u)
    h_ref, vjp_ref = jax.vjp(ref, g, u)
    assert h.dtype == jnp.bfloat16
    for got, want in zip((h, *jax.jit(vjp)(d)), (h_ref, *vjp_ref(d.astype(jnp.float32)))):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_array_less(np.abs(got - want), 2 ** -8 * np.abs(want) + 1e-6)


def test_chunked_loss_bf16_equals_full_logits_within_bf16_tolerance():
    kh, kw, kt = jax.random.split(jax.random.PRNGKey(2), 3)
    h = jax.random.normal(kh, (2, 40, 32), jnp.float32).astype(jnp.bfloat16)
    w = 0.2 * jax.random.normal(kw, (32, 300), jnp.float32)
    t = jax.random.randint(kt, (2, 40), 0, 300)
    full = lambda h, w: cross_entropy(jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32), t)  # noqa
    fused = lambda h, w: chunked_cross_entropy(h, w, t, 16)  # noqa: E731
    (l1, (dh1, dw1)), (l2, (dh2, dw2)) = [jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w) for f in (full, fused)]
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dh1, np.float32), np.asarray(dh2, np.float32), rtol=2e-2, atol=2e-4)
    np.testing.assert_allclose(np.asarray(dw1), np.asarray(dw2), rtol=2e-2, atol=2e-4)


def _loss_and_grads(dtype, chunk):
    c = tiny_config("resformer")
    c.model.dtype = dtype
    m = Transformer(c.model)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (4, c.data.seq_len + 1), 0, c.model.vocab_size)
    params = jax.jit(m.init)(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
    import flax.linen as nn
    params = nn.unbox(params)
    return params, jax.jit(jax.value_and_grad(lambda p: loss_fn(p, m, tokens, chunk)))(params)


def test_tiny_model_bf16_loss_and_gradients_track_fp32():
    """The whole bf16 step (mixed matmuls, fused loss) against fp32 on the same parameters and batch."""
    _, (l32, g32) = _loss_and_grads("float32", 8)
    _, (l16, g16) = _loss_and_grads("bfloat16", 8)
    _, (l16_full, _) = _loss_and_grads("bfloat16", 0)
    assert abs(float(l16) - float(l32)) < 2e-2 * abs(float(l32)), (float(l16), float(l32))
    assert abs(float(l16) - float(l16_full)) < 1e-3 * abs(float(l32))  # fused == full logits, both bf16
    for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g16)):
        assert b.dtype == jnp.float32
        cos = float(jnp.vdot(a.ravel(), b.ravel()) / (jnp.linalg.norm(a) * jnp.linalg.norm(b) + 1e-30))
        assert cos > 0.99, cos
