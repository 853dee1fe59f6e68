"""bf16 compute on CPU: the fast paths equal the plain ones.

The bf16 matmuls take fp32 accumulation and canonical layouts (model/layers.py `mixed_matmul`, `transposed`;
train/loss.py); fp32 keeps its exact old code path (tests/project/test_structure.py pins its losses bitwise).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resformer_jax.kernels.cpu_matmul import mixed_matmul, rounded_matmul, rounded_swiglu, swiglu_mlp, transposed
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig
from resformer_jax.presets import tiny_config
from resformer_jax.resolve import for_backend
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
    ref = lambda x, w: jnp.dot(x.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32))
    y, vjp = jax.vjp(mixed_matmul, x, w)
    y_ref, vjp_ref = jax.vjp(ref, x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-5)  # fp32 accumulation
    dx, dw = jax.jit(vjp)(g)
    dx_ref, dw_ref = vjp_ref(g)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32  # the parameter's gradient never rounded to bf16
    # bf16 cotangent rounding: relative error about 2^-8 of each product's magnitude
    scale_x = np.abs(np.asarray(g)) @ np.abs(np.asarray(w)).T
    np.testing.assert_array_less(
        np.abs(np.asarray(dx, np.float32) - np.asarray(dx_ref, np.float32)), 1e-2 * scale_x + 1e-3
    )
    scale_w = np.abs(np.asarray(x, np.float32)).T @ np.abs(np.asarray(g))
    np.testing.assert_array_less(np.abs(np.asarray(dw) - np.asarray(dw_ref)), 1e-2 * scale_w + 1e-3)


def _mlp_inputs(dtype):
    k = jax.random.split(jax.random.PRNGKey(3), 5)
    x = jax.random.normal(k[0], (64, 32), jnp.float32).astype(dtype)
    wg, wu = (0.3 * jax.random.normal(kk, (32, 96), jnp.float32) for kk in k[1:3])
    wd = 0.3 * jax.random.normal(k[3], (96, 32), jnp.float32)
    dy = jax.random.normal(k[4], (64, 32), jnp.float32).astype(dtype)
    return (x, wg, wu, wd), dy


def _plain_mlp(x, wg, wu, wd):
    """What autodiff differentiates without swiglu_mlp: down(silu(gate(x)) * up(x)) in fp32."""
    x = x.astype(jnp.float32)
    return jnp.dot(jax.nn.silu(jnp.dot(x, wg)) * jnp.dot(x, wu), wd)


def test_swiglu_mlp_fp32_is_the_plain_expression_with_its_gradients():
    """fp32: the fused MLP's value is the plain expression bit for bit; its hand-written VJP (saves gate and up,
    recomputes the product) gives autodiff's gradients to fp32 rounding."""
    args, dy = _mlp_inputs(jnp.float32)
    y, vjp = jax.vjp(lambda *a: swiglu_mlp(*a, jnp.dtype(jnp.float32)), *args)
    y_ref, vjp_ref = jax.vjp(_plain_mlp, *args)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    for got, want in zip(jax.jit(vjp)(dy), vjp_ref(dy)):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_swiglu_mlp_bf16_against_autodiff_in_fp32():
    """bf16: value and the four gradients against autodiff of the fp32 expression on the same rounded inputs,
    within bf16 rounding of each product; weight gradients stay fp32, the input's is bf16."""
    args, dy = _mlp_inputs(jnp.bfloat16)
    y, vjp = jax.vjp(lambda *a: swiglu_mlp(*a, jnp.dtype(jnp.bfloat16)), *args)
    rounded = [a.astype(jnp.bfloat16).astype(jnp.float32) for a in args]
    y_ref, vjp_ref = jax.vjp(_plain_mlp, *rounded)
    grads, grads_ref = jax.jit(vjp)(dy), vjp_ref(dy.astype(jnp.float32))
    assert y.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
    assert all(g.dtype == jnp.float32 for g in grads[1:])  # parameters' gradients never rounded to bf16
    for got, want in zip((y, *grads), (y_ref, *grads_ref)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        # three roundings to bf16 on the way (gate/up, the product, the cotangent): a few 2^-8 of the scale
        np.testing.assert_array_less(np.abs(got - want), 4 * 2**-8 * np.abs(want).max())


def test_rounded_forms_equal_the_bf16_forms():
    """model.matmuls="rounded" (the decode engine's on a CPU): fp32 weights holding bf16 values, fp32 arithmetic.
    The matmul is mixed_matmul's product of the same rounded operands to fp32 summation order; the MLP is
    swiglu_mlp's bf16 forward within one rounding to bf16 (its gate, up and product are rounded the same way)."""
    k = jax.random.split(jax.random.PRNGKey(5), 2)
    x = jax.random.normal(k[0], (3, 48), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k[1], (48, 40), jnp.float32)
    w_rounded = w.astype(jnp.bfloat16).astype(jnp.float32)
    got, want = jax.jit(rounded_matmul)(x, w_rounded), jax.jit(mixed_matmul)(x, w)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)
    (x, wg, wu, wd), _ = _mlp_inputs(jnp.bfloat16)
    bf16 = jnp.dtype(jnp.bfloat16)
    rounded = [a.astype(jnp.bfloat16).astype(jnp.float32) for a in (wg, wu, wd)]
    got = np.asarray(jax.jit(rounded_swiglu, static_argnums=4)(x, *rounded, bf16), np.float32)
    want = np.asarray(jax.jit(swiglu_mlp, static_argnums=4)(x, wg, wu, wd, bf16), np.float32)
    np.testing.assert_array_less(np.abs(got - want), 2**-8 * np.abs(want) + 1e-6 * np.abs(want).max())


def test_chunked_loss_bf16_equals_full_logits_within_bf16_tolerance():
    kh, kw, kt = jax.random.split(jax.random.PRNGKey(2), 3)
    h = jax.random.normal(kh, (2, 40, 32), jnp.float32).astype(jnp.bfloat16)
    w = 0.2 * jax.random.normal(kw, (32, 300), jnp.float32)
    t = jax.random.randint(kt, (2, 40), 0, 300)
    full = lambda h, w: cross_entropy(jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32), t)
    fused = lambda h, w: chunked_cross_entropy(h, w, t, 16)
    (l1, (dh1, dw1)), (l2, (dh2, dw2)) = [jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w) for f in (full, fused)]
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dh1, np.float32), np.asarray(dh2, np.float32), rtol=2e-2, atol=2e-4)
    np.testing.assert_allclose(np.asarray(dw1), np.asarray(dw2), rtol=2e-2, atol=2e-4)


def _loss_and_grads(dtype, chunk):
    c = tiny_config("resformer")
    c.model.dtype = dtype
    m = Transformer(for_backend(ModelConfig.of(c.model)))
    tokens = jax.random.randint(jax.random.PRNGKey(3), (4, c.data.seq_len + 1), 0, c.model.vocab_size)
    params = jax.jit(m.init)(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
    import flax.linen as nn

    params = nn.unbox(params)
    return params, jax.jit(jax.value_and_grad(lambda p: loss_fn(p, m, tokens, chunk)))(params)


@pytest.mark.slow  # over 12 s in the fast tier
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


def test_dtype_auto_is_the_same_every_time_under_a_noisy_clock_and_float32_without_bf16_instructions():
    """#73: `model.dtype=auto` on a CPU. With bf16 instructions, speeds equal but each reading off by up to 35% (a
    busy host): float32 every time, over 200 independent clocks; a real 3x gain: bfloat16 every time. Without them:
    float32 and no timing at all."""
    from resformer_jax.model.config import ModelConfig
    from resformer_jax.perf import faster_cpu_dtype

    m = ModelConfig(d_model=64, num_layers=2, num_heads=4, ffn_dim=128, vocab_size=256)

    def clock(seed, bf16_speedup):
        rng = np.random.default_rng(seed)
        return lambda shape, dtype: (1.0 / (bf16_speedup if dtype == "bfloat16" else 1.0)) * rng.uniform(0.65, 1.35)

    assert {faster_cpu_dtype(m, 512, timer=clock(s, 1.0), has_bf16=True)[0] for s in range(200)} == {"float32"}
    assert {faster_cpu_dtype(m, 512, timer=clock(s, 3.0), has_bf16=True)[0] for s in range(200)} == {"bfloat16"}

    def no_clock(shape, dtype):
        raise AssertionError("timed on a CPU without bf16 instructions")

    choice, why = faster_cpu_dtype(m, 512, timer=no_clock, has_bf16=False)
    assert choice == "float32" and "not timed" in why
