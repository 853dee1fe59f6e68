"""Attention kernels: pallas (interpret mode on CPU), xla and cudnn against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import fast_few

from resformer_jax import kernels
from resformer_jax.commands.training import run
from resformer_jax.kernels import attention as dispatch
from resformer_jax.kernels import probe
from resformer_jax.metrics import read_jsonl
from resformer_jax.model.config import ModelConfig
from resformer_jax.presets import tiny_config

SHAPES = [(T, H, K, 64) for T in (1, 7, 128, 300) for H, K in ((4, 4), (8, 2), (8, 1))]
SHAPES += [(7, 8, 2, 128), (300, 8, 1, 128), (128, 4, 4, 128)]
SHAPES += [(70, 4, 2, 80)]  # StableLM-3B's head width: the Triton kernel pads it to 128 with zero columns
BF16_SHAPES = [(128, 8, 2, 64), (300, 8, 1, 128), (7, 4, 4, 64)]


def fwd_bwd(impl, q, k, v, do):
    def f(q, k, v):
        return dispatch.attention(q, k, v, causal=True, impl=impl)

    @jax.jit
    def go(q, k, v, do):
        o, vjp = jax.vjp(f, q, k, v)
        return (o,) + vjp(do)

    return go(q, k, v, do)


def inputs(T, H, K, D, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed * 1000 + T * 7 + H + K + D), 4)
    q = jax.random.normal(ks[0], (2, T, H, D), jnp.float32)
    k = jax.random.normal(ks[1], (2, T, K, D), jnp.float32)
    v = jax.random.normal(ks[2], (2, T, K, D), jnp.float32)
    do = jax.random.normal(ks[3], (2, T, H, D), jnp.float32)
    return [x.astype(dtype) for x in (q, k, v, do)]


def _out_and_grads(f, args, do):
    """f(*args) and the gradients of all its arguments for the output cotangent do."""
    o, vjp = jax.vjp(f, *args)
    return (o,) + vjp(do)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return np.linalg.norm(a - b) / nb if nb > 1e-6 else np.linalg.norm(a)


# the fast tier: a decode row, a short odd length in MHA, a long one in MQA, and the padded head width
@pytest.mark.parametrize(
    "T,H,K,D", fast_few(SHAPES, [(1, 8, 2, 64), (7, 4, 4, 64), (128, 8, 1, 64), (70, 4, 2, 80)], True)
)
def test_fp32_outputs_and_grads_match_reference(T, H, K, D):
    args = inputs(T, H, K, D, jnp.float32)
    want = fwd_bwd("reference", *args)
    for impl in ("pallas", "chunked", "xla"):
        got = fwd_bwd(impl, *args)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert rel(g, w) < 1e-5, f"{impl} {name} at T={T} H/K={H}/{K} D={D}: {rel(g, w):.2e}"


@pytest.mark.parametrize("T,H,K,D", fast_few(BF16_SHAPES, [(7, 4, 4, 64)], True))
def test_bf16_inputs_against_fp32_reference(T, H, K, D):
    args16 = inputs(T, H, K, D, jnp.bfloat16)
    want = fwd_bwd("reference", *[x.astype(jnp.float32) for x in args16])
    for impl in ("pallas", "chunked", "xla"):
        got = fwd_bwd(impl, *args16)
        assert got[0].dtype == jnp.bfloat16
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert rel(g, w) < 2e-2, f"{impl} {name} bf16 at T={T}: {rel(g, w):.2e}"


VALUE_MIX_CASES = [
    (7, 4, 4, 64, False, True),
    (130, 8, 2, 64, False, True),
    (300, 4, 4, 128, True, False),
    (70, 2, 1, 32, True, True),
    (33, 2, 1, 80, True, True),
]


@pytest.mark.parametrize(
    "T,H,K,D,documents,lambda_grads",
    fast_few(VALUE_MIX_CASES, [(7, 4, 4, 64, False, True), (70, 2, 1, 32, True, True)], True),
)
def test_pallas_value_mix_equals_attention_over_the_mixed_value(T, H, K, D, documents, lambda_grads):
    """ResFormer's Eq. 7 formed inside the kernels (value_mix): the output and the gradients of q, k, V_n, V_1 and
    (l1, l2) equal attention over l1 V_1 + l2 V_n formed first (GQA, odd lengths, packed documents); with
    lambda_grads=False the lambdas' gradient is zero (constants)."""
    q, k, v, do = inputs(T, H, K, D, jnp.float32, seed=3)
    v1 = jax.random.normal(jax.random.PRNGKey(T + 1), v.shape)
    lam = jnp.array([0.3, 0.8], jnp.float32)
    segments = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(T), 0.04, (2, T)), axis=1) if documents else None

    def mixed_first(q, k, v, v1, lam):
        return dispatch.attention(q, k, lam[0] * v1 + lam[1] * v, impl="reference", segments_BxT=segments)

    def in_kernel(q, k, v, v1, lam):
        mix = (v1, lam if lambda_grads else jax.lax.stop_gradient(lam))
        return dispatch.attention(
            q, k, v, impl="pallas", segments_BxT=segments, value_mix=mix, lambda_grads=lambda_grads
        )

    want, got = (
        _out_and_grads(mixed_first, (q, k, v, v1, lam), do),
        jax.jit(lambda: _out_and_grads(in_kernel, (q, k, v, v1, lam), do))(),
    )
    for name, g, w in zip(("out", "dq", "dk", "dv_n", "dv_1", "dlambdas"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if name == "dlambdas" and not lambda_grads:
            assert not np.any(np.asarray(g)), "constant lambdas: no gradient"
            continue
        assert rel(g, w) < 1e-5, f"{name} at T={T} H/K={H}/{K} D={D} documents={documents}: {rel(g, w):.2e}"


@pytest.mark.parametrize(
    "T,H,K,D,documents",
    fast_few([(7, 4, 4, 64, False), (130, 8, 2, 64, True), (70, 2, 1, 32, False)], [(7, 4, 4, 64, False)], True),
)
def test_pallas_gated_value_mix_equals_attention_over_the_gated_value(T, H, K, D, documents):
    """resformer_lambdas=gated inside the kernels: a gate g per key row and kv head, g V_1 + (1 - g) V_n formed
    as each block of V loads; the output and the gradients of q, k, V_n, V_1 and g equal attention over the mix
    formed first as model/attention.gated_value forms it (GQA sums the gate's gradient over a kv head's queries)."""
    from resformer_jax.model.attention import ValueMix, gated_value

    q, k, v, do = inputs(T, H, K, D, jnp.float32, seed=4)
    v1 = jax.random.normal(jax.random.PRNGKey(T + 2), v.shape)
    gate = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(T + 3), v.shape[:3]))
    segments = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(T), 0.04, (2, T)), axis=1) if documents else None

    def mixed_first(q, k, v, v1, gate):
        mixed = gated_value(ValueMix(v, v1, None, None, None, v.dtype, None, None, gate))
        return dispatch.attention(q, k, mixed, impl="reference", segments_BxT=segments)

    def in_kernel(q, k, v, v1, gate):
        return dispatch.attention(q, k, v, impl="pallas", segments_BxT=segments, value_mix=(v1, gate))

    want, got = (
        _out_and_grads(mixed_first, (q, k, v, v1, gate), do),
        jax.jit(lambda: _out_and_grads(in_kernel, (q, k, v, v1, gate), do))(),
    )
    for name, g, w in zip(("out", "dq", "dk", "dv_n", "dv_1", "dgate"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert rel(g, w) < 1e-5, f"{name} at T={T} H/K={H}/{K} D={D} documents={documents}: {rel(g, w):.2e}"


def test_value_mix_is_refused_where_no_kernel_forms_it():
    x = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="value mix"):
        dispatch.attention(x, x, x, impl="xla", value_mix=(x, jnp.array([0.5, 0.5])))


def test_reference_returns_causal_probabilities():
    q, k, v, _ = inputs(9, 4, 2, 64, jnp.float32)
    _, p = dispatch.reference_attention(q, k, v, return_probs=True)
    assert p.shape == (2, 4, 9, 9)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
    assert float(jnp.abs(jnp.triu(p, 1)).max()) == 0.0


def test_named_impl_that_cannot_run_raises():
    q, k, v, _ = inputs(8, 4, 4, 64, jnp.float32)
    with pytest.raises(kernels.KernelUnavailable, match="cudnn"):
        dispatch.attention(q, k, v, impl="cudnn")


def test_auto_probe_on_a_gpu_times_every_candidate_and_keeps_the_fastest():
    """With the backend injected as GPU, here on a CPU: pallas runs (interpreted), cudnn cannot run, xla runs; the
    probe times both that run and keeps the faster, naming each time: a clock that makes pallas's runs 3 ms and
    xla's 2 ms picks xla (a shared host's timing noise cannot flip it)."""
    msgs, ticks = [], iter([0.0, 0.003] * 3 + [0.0, 0.002] * 3)  # (start, end) of each timed run, pallas then xla
    choice, rejected = probe.probe_auto(
        (1, 128, 2, 32), 2, jnp.float32, msgs.append, backend="gpu", clock=lambda: next(ticks)
    )
    assert choice == "xla" and "cudnn" in rejected and "pallas" not in rejected, (choice, rejected)
    assert "fastest forward+backward" in msgs[0] and "pallas 3.00 ms" in msgs[0] and "xla 2.00 ms" in msgs[0], msgs


def test_auto_probe_times_resformer_layers_on_their_value_mix(monkeypatch):
    """For ResFormer (value_mix), each candidate is timed on what its layers run: pallas with the mix inside
    (value_mix passed to the kernel), the others on the value mixed first; the log says so."""
    seen = []
    real = dispatch.attention

    def spy(q, k, v, **kw):
        seen.append((kw["impl"], kw.get("value_mix") is not None))
        return real(q, k, v, **kw)

    monkeypatch.setattr(dispatch, "attention", spy)
    msgs, ticks = [], iter([0.0, 0.002] * 3 + [0.0, 0.003] * 3)
    choice, _ = probe.probe_auto(
        (1, 64, 2, 32), 2, jnp.float32, msgs.append, backend="gpu", clock=lambda: next(ticks), value_mix=True
    )
    assert choice == "pallas" and ("pallas", True) in seen and ("xla", False) in seen, (choice, seen)
    assert "with ResFormer's value mix" in msgs[0], msgs
    from resformer_jax.model.attention import kernel_can_mix_values
    from resformer_jax.model.config import ModelConfig

    kinds = {v: kernel_can_mix_values(ModelConfig.of(tiny_config(v).model)) for v in ("resformer", "svformer", "none")}
    assert kinds == {"resformer": True, "svformer": False, "none": False}, kinds


def test_auto_probe_on_cpu_chooses_chunked_with_reasons():
    msgs = []
    choice, rejected = probe.probe_auto((1, 16, 4, 16), 2, jnp.float32, msgs.append)
    assert choice == "chunked" and "pallas" in rejected and "cudnn" in rejected
    assert "auto chose 'chunked'" in msgs[0]


@pytest.mark.parametrize(
    "T,S,block,causal",
    fast_few(
        [
            (7, 7, 3, True),
            (300, 300, 64, True),
            (64, 64, 16, True),
            (5, 12, 2, True),
            (1, 9, 1, True),
            (9, 9, 4, False),
        ],
        [(7, 7, 3, True), (5, 12, 2, True), (9, 9, 4, False)],
        True,
    ),
)
def test_chunked_blocks_and_decode_alignment_match_reference(T, S, block, causal):
    """Many query blocks (each seeing only its key prefix), ragged last block, queries aligned
    at the end of a longer key sequence (S > T, as in decode), and no mask at all. The
    backward is chunked_attention's own (custom VJP from the saved log-sum-exp)."""
    from resformer_jax.kernels.chunked_attention import chunked_attention

    ks = jax.random.split(jax.random.PRNGKey(T * 31 + S), 4)
    q = jax.random.normal(ks[0], (2, T, 8, 32))
    k = jax.random.normal(ks[1], (2, S, 2, 32))
    v = jax.random.normal(ks[2], (2, S, 2, 32))
    do = jax.random.normal(ks[3], (2, T, 8, 32))

    def run_impl(f):
        o, vjp = jax.vjp(f, q, k, v)
        return (o,) + vjp(do)

    want = run_impl(lambda q, k, v: dispatch.reference_attention(q, k, v, causal=causal))
    got = jax.jit(lambda: run_impl(lambda q, k, v: chunked_attention(q, k, v, causal=causal, block=block)))()
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel(g, w) < 1e-5, f"chunked {name} T={T} S={S} block={block}: {rel(g, w):.2e}"


@pytest.mark.parametrize(
    "T,S,block,pairs", fast_few([(300, 300, 64, 1), (64, 64, 16, 3), (5, 12, 2, 2)], [(5, 12, 2, 2)], True)
)
def test_chunked_pairs_loop_matches_the_batched_form(T, S, block, pairs):
    """The CPU path runs the blocks a few (batch, kv-head) pairs at a time (lax.map; 3 of 4 pairs leaves a
    remainder step): the same ops per pair, so output and gradients equal the all-at-once form up to the
    summation order inside a matmul of another shape."""
    from resformer_jax.kernels.chunked_attention import chunked_attention

    ks = jax.random.split(jax.random.PRNGKey(T + S), 4)
    q, do = jax.random.normal(ks[0], (2, T, 8, 32)), jax.random.normal(ks[3], (2, T, 8, 32))
    k, v = jax.random.normal(ks[1], (2, S, 2, 32)), jax.random.normal(ks[2], (2, S, 2, 32))

    def run(p):
        o, vjp = jax.vjp(lambda q, k, v: chunked_attention(q, k, v, block=block, pairs=p), q, k, v)
        return (o,) + vjp(do)

    for name, a, b in zip(("out", "dq", "dk", "dv"), jax.jit(lambda: run(pairs))(), jax.jit(lambda: run(0))()):
        assert rel(a, b) < 1e-6, f"pairs={pairs} {name}: {rel(a, b):.2e}"


def test_chunked_loops_over_pairs_only_on_cpu():
    """Behind the platform: a CPU program loops over pairs; one compiled for a GPU keeps the batched form
    unchanged, and so does a CPU program under a multi-device mesh (its batch axis is sharded)."""
    from resformer_jax.kernels.chunked_attention import chunked_attention, pairs_per_step
    from resformer_jax.kernels.names import compiling_for

    q, kv = jnp.ones((2, 256, 4, 64)), jnp.ones((2, 256, 4, 64))
    loops = lambda f: "scan" in str(jax.make_jaxpr(jax.grad(lambda q: f(q).sum()))(q))
    assert pairs_per_step(1, 128, 256) == 4  # [128, 256] fp32 logits: 128 KiB a pair
    assert loops(lambda q: chunked_attention(q, kv, kv))
    with compiling_for("cuda"):
        assert not loops(lambda q: chunked_attention(q, kv, kv))
    mesh = jax.make_mesh((2, 1), ("data", "fsdp"), devices=jax.devices()[:2])
    assert not loops(lambda q: dispatch.attention(q, kv, kv, impl="chunked", mesh=mesh))


@pytest.mark.slow
@pytest.mark.parametrize("lambdas,scan", [("fixed", False), ("learnable", True)])
def test_tiny_model_trains_the_same_with_pallas_and_xla(tmp_path, lambdas, scan):
    """ResFormer with pallas forms Eq. 7 inside the kernel (the learnable lambdas' gradients come from it too):
    the same losses as XLA's attention over the value mixed first."""
    out = {}
    for impl in ("pallas", "xla"):
        c = tiny_config("resformer")
        c.model.attention_impl = impl
        c.model.num_kv_heads = 2
        c.model.resformer_lambdas, c.model.scan_layers = lambdas, scan
        c.train.steps, c.train.log_every, c.train.eval_every = 3, 1, 1000
        c.mesh.num_devices = 1
        wd = str(tmp_path / impl)
        assert run(c, wd) == 0
        out[impl] = read_jsonl(f"{wd}/metrics.jsonl", "train/loss")
    for s in (1, 2, 3):
        np.testing.assert_allclose(out["pallas"][s], out["xla"][s], rtol=1e-5)


@pytest.mark.parametrize("T,H,K", fast_few([(128, 4, 2), (200, 4, 4)], [(200, 4, 4)], True))
def test_splash_tpu_kernel_matches_reference_interpreted(T, H, K):
    """JAX's TPU splash kernel behind impl='splash' (interpreted here): GQA and a length padded to 128."""
    ks = jax.random.split(jax.random.PRNGKey(T), 4)
    q = jax.random.normal(ks[0], (2, T, H, 64))
    k = jax.random.normal(ks[1], (2, T, K, 64))
    v = jax.random.normal(ks[2], (2, T, K, 64))
    do = jax.random.normal(ks[3], (2, T, H, 64))

    def run_impl(f):
        o, vjp = jax.vjp(f, q, k, v)
        return (o,) + vjp(do)

    want = run_impl(lambda q, k, v: dispatch.reference_attention(q, k, v))
    got = jax.jit(lambda: run_impl(lambda q, k, v: dispatch.attention(q, k, v, impl="splash")))()
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel(g, w) < 1e-5, f"splash {name} T={T}: {rel(g, w):.2e}"


@pytest.mark.slow  # over 12 s in the fast tier
@pytest.mark.parametrize("lambdas", ["fixed", "gated"])
def test_custom_call_kernels_run_per_batch_shard_on_a_mesh(tmp_path, lambdas):
    """Under a data x fsdp mesh, pallas runs through shard_map (XLA cannot partition a custom call):
    the same losses as XLA's attention and norm on the same mesh (the gated mix's gate split as V)."""
    out = {}
    for impl in ("pallas", "xla"):
        c = tiny_config("resformer")  # the value mix and the queries' RoPE in the kernel, per shard (V_1 split as V)
        c.model.resformer_lambdas = lambdas
        c.model.attention_impl = impl
        c.model.norm_impl = impl  # the norm kernels per shard too
        c.train.steps, c.train.warmup_steps, c.train.log_every, c.train.eval_every = 3, 1, 1, 1000
        c.mesh.data, c.mesh.fsdp = 4, 2
        wd = str(tmp_path / impl)
        assert run(c, wd) == 0
        out[impl] = read_jsonl(f"{wd}/metrics.jsonl", "train/loss")
    for s in (1, 2, 3):
        np.testing.assert_allclose(out["pallas"][s], out["xla"][s], rtol=1e-5)


def _plain_rms_norm(h, scale, eps, dtype):
    """RMSNorm as tests/support/reference.py writes it (the model's XLA path computes the same)."""
    x = h.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale).astype(dtype)


@pytest.mark.parametrize(
    "shape,dtype,outputs",
    fast_few(
        [((2, 37, 64), jnp.float32, 1), ((3, 128, 128), jnp.bfloat16, 2), ((1, 5, 16), jnp.float32, 3)],
        [((2, 37, 64), jnp.float32, 1)],
        True,
    ),
)
def test_pallas_rms_norm_and_its_gradients_equal_the_plain_norm(shape, dtype, outputs):
    """The norm kernels (interpreted) against the plain norm: y, and the gradients of h (the residual stream's own
    gradient added, the consumers' gradients summed) and of scale; odd row counts pad to the kernels' blocks."""
    ks = jax.random.split(jax.random.PRNGKey(shape[1]), 3 + outputs)
    h = jax.random.normal(ks[0], shape, jnp.float32).astype(dtype)
    scale = 1.0 + 0.1 * jax.random.normal(ks[1], shape[-1:], jnp.float32)
    cts = [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in ks[2:]]  # the stream's, then each y's

    def through_kernel(h, scale):
        outs = kernels.rms_norm(h, scale, eps=1e-5, out_dtype=dtype, passes=True, outputs=outputs)
        assert len(outs) == 1 + outputs
        return sum(jnp.vdot(o.astype(jnp.float32), c.astype(jnp.float32)) for o, c in zip(outs, cts))

    def plain(h, scale):
        outs = (h,) + (_plain_rms_norm(h, scale, 1e-5, dtype),) * outputs
        return sum(jnp.vdot(o.astype(jnp.float32), c.astype(jnp.float32)) for o, c in zip(outs, cts))

    y = kernels.rms_norm(h, scale, eps=1e-5, out_dtype=dtype)
    assert y.dtype == dtype and y.shape == shape
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert rel(y, _plain_rms_norm(h, scale, 1e-5, dtype)) < tol
    got, want = jax.grad(through_kernel, (0, 1))(h, scale), jax.grad(plain, (0, 1))(h, scale)
    for name, g, w in zip(("dh", "dscale"), got, want):
        assert g.dtype == w.dtype and rel(g, w) < tol, f"{name}: {rel(g, w):.2e}"
    g1 = jax.grad(
        lambda h, s: jnp.vdot(
            kernels.rms_norm(h, s, eps=1e-5, out_dtype=dtype).astype(jnp.float32), cts[1].astype(jnp.float32)
        ),
        (0, 1),
    )(h, scale)
    w1 = jax.grad(
        lambda h, s: jnp.vdot(_plain_rms_norm(h, s, 1e-5, dtype).astype(jnp.float32), cts[1].astype(jnp.float32)),
        (0, 1),
    )(h, scale)
    for name, g, w in zip(("dh alone", "dscale alone"), g1, w1):
        assert rel(g, w) < tol, f"{name}: {rel(g, w):.2e}"


def test_norm_impl_auto_is_the_kernels_on_a_gpu_where_they_apply_and_a_named_one_that_cannot_run_is_refused():
    """model.norm_impl: auto resolves per backend (the Pallas kernels on a GPU for Llama's RMSNorm at a power-of-two
    d_model, XLA's norm elsewhere); pallas named for a width a Triton block cannot span, or for GPT-2's LayerNorm,
    is one ConfigError naming the fix."""
    from resformer_jax.config import ConfigError
    from resformer_jax.resolve import for_backend

    m = ModelConfig.of(tiny_config("resformer").model)
    assert m.norm_impl == "auto" and not m.norms_in_kernel
    assert for_backend(m, "gpu").norms_in_kernel
    assert for_backend(m, "cpu").norm_impl == "xla" and for_backend(m, "tpu").norm_impl == "xla"
    assert for_backend(m.replace(d_model=96, num_heads=2), "gpu").norm_impl == "xla"
    assert for_backend(m.replace(norm_impl="xla"), "gpu").norm_impl == "xla"
    for bad in (dict(d_model=96, num_heads=2), dict(arch="gpt2")):
        with pytest.raises(ConfigError, match="norm_impl") as e:
            m.replace(norm_impl="pallas", **bad)
        assert "auto or xla" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "T,H,K,D,documents",
    fast_few([(7, 4, 4, 64, False), (130, 8, 2, 64, True), (70, 2, 1, 128, False)], [(7, 4, 4, 64, False)], True),
)
def test_pallas_rope_inside_the_kernel_equals_rotating_q_and_k_first(T, H, K, D, documents):
    """rope: the kernel takes q and k before RoPE, rotates them, and its dQ and dK/dV kernels rotate the gradients
    back (by the head's halves): output and dQ/dK/dV as RoPE by kernels/rope.py and then the reference attention."""
    from resformer_jax.kernels.rope import inverse_frequencies, rotate_half

    q, k, v, do = inputs(T, H, K, D, jnp.float32, seed=3)
    positions = jnp.broadcast_to(jnp.arange(T)[None], (2, T))
    seg = None
    if documents:  # positions restart at each document, as the model's packed sequences' do
        seg = jnp.broadcast_to((jnp.arange(T) >= T // 3).astype(jnp.int32)[None], (2, T))
        positions = jnp.where(seg == 1, positions - T // 3, positions)
    inv_freq = inverse_frequencies(D, 10000.0)

    def kernel(q, k, v):
        return dispatch.attention(q, k, v, impl="pallas", segments_BxT=seg, rope=(positions, inv_freq))

    def reference(q, k, v):
        qr, kr = rotate_half(q, positions, inv_freq), rotate_half(k, positions, inv_freq)
        return dispatch.attention(qr, kr, v, impl="reference", segments_BxT=seg)

    got_o, got_vjp = jax.vjp(kernel, q, k, v)
    want_o, want_vjp = jax.vjp(reference, q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got_o, *got_vjp(do)), (want_o, *want_vjp(do))):
        assert rel(g, w) < 1e-5, f"{name} T={T} H/K={H}/{K} D={D}: {rel(g, w):.2e}"
    with pytest.raises(ValueError, match="RoPE"):
        dispatch.attention(q, k, v, impl="xla", rope=(positions, inv_freq))


def test_norm_auto_on_a_gpu_times_the_kernels_against_xla_and_falls_back_when_they_fail(monkeypatch):
    """kernels.probe_norm (norm_impl=auto on a GPU): the faster forward+backward wins, each time logged; kernels
    that fail are XLA's norm, with the reason. The clock is injected; the kernels run interpreted here."""

    def clock_for(pallas_s, xla_s):
        ticks = iter([0.0, pallas_s] * 3 + [0.0, xla_s] * 3)
        return lambda: next(ticks)

    logs: list[str] = []
    assert probe.probe_norm(64, 32, jnp.float32, logs.append, clock=clock_for(1e-3, 2e-3)) == "pallas"
    assert probe.probe_norm(64, 32, jnp.float32, logs.append, clock=clock_for(2e-3, 1e-3)) == "xla"
    assert "norm_impl=auto chose 'pallas'" in logs[0] and "pallas 1.000 ms; xla 2.000 ms" in logs[0]

    def broken(*args, **kwargs):
        raise RuntimeError("Triton could not compile it")

    monkeypatch.setattr(kernels, "rms_norm", broken)
    ticks = iter([0.0, 1e-3] * 3)
    assert probe.probe_norm(64, 32, jnp.float32, logs.append, clock=lambda: next(ticks)) == "xla"
    assert "the kernels failed (RuntimeError: Triton could not compile it)" in logs[-1]
