"""The decode engine (resformer_jax/engine/): greedy tokens equal the model's own (the cache-free forward,
tests/reference.model_greedy), for requests of mixed lengths that arrive while others decode, through a pool too
small for all of them at once; the pool ends empty; a handful of compiles; bad input named."""

import dataclasses
import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import model_greedy
from tiers import fast_few

from resformer_jax.engine import Engine, EngineError, SamplingParams
from resformer_jax.engine import runner as runner_module
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.transformer import cache_bytes_per_token
from resformer_jax.presets import tiny_config
from resformer_jax.resolve import for_backend

VARIANTS = {
    "none": {},
    "resformer": {},
    "svformer": {},
    "skipv1": {},
    "resformer+gqa": {"num_kv_heads": 2},
    "svformer+gqa": {"num_kv_heads": 2},
    "resformer+value_embeddings": {"value_embeddings": 1},
    "resformer+learnable": {"resformer_lambdas": "learnable"},
}


def peaky_model(variant: str, **fields):
    """A tiny fp32 model whose next-token logits are far apart (a random init's are nearly flat, and a tie decided
    by the last bit would make greedy comparisons flaky): the LM head scaled up. Built once per (variant, fields)
    in a worker: the engine's programs, keyed by the model, are then traced and compiled once for all its tests."""
    m, params = _peaky_model(variant, tuple(sorted(fields.items())))
    return m, dict(params)


@functools.cache
def _peaky_model(variant: str, fields: tuple):
    c = tiny_config(variant.split("+")[0])
    c.model.dtype = "float32"
    for k, v in fields:
        c.model[k] = v
    m = for_backend(ModelConfig.of(c.model))
    params = nn.unbox(Transformer(m).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    params = dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * 40.0})
    return m, params


def arrive_while_decoding(engine, prompts, sampling, per_step):
    """Submit `per_step` requests before each engine step (the earlier ones decoding meanwhile), then step until
    every request has ended. Returns the requests in submission order."""
    reqs = []
    for i in range(0, len(prompts), per_step):
        reqs += [engine.submit(p, s) for p, s in zip(prompts[i : i + per_step], sampling[i : i + per_step])]
        engine.step()
    while engine.busy:
        engine.step()
    return reqs


def prompts_of(rng, n, vocab, lo=1, hi=40):
    return [[int(t) for t in rng.integers(0, vocab, size=int(k))] for k in rng.integers(lo, hi, size=n)]


@pytest.mark.slow  # a variant's engine and reference programs, 5-7 s cold on 2 cores; the fast tier's greedy rows
@pytest.mark.parametrize("variant", list(VARIANTS))  # are those beside the penalized and masked ones below
def test_greedy_tokens_equal_the_cache_free_forward(variant):
    m, params = peaky_model(variant, **VARIANTS[variant])
    rng = np.random.default_rng(1)
    prompts = prompts_of(rng, 6, m.vocab_size)
    engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=8, prefill_chunk=16)
    got = engine.generate(prompts, SamplingParams(max_tokens=8))
    for p, r in zip(prompts, got):
        assert r.tokens == model_greedy(m, params, p, 8), f"{variant}: prompt of {len(p)} tokens"
        assert r.finish_reason == "length"
    assert engine.pool.used == 0


@pytest.mark.parametrize("decode_steps", fast_few([1, 4], [1]))
def test_penalized_greedy_tokens_equal_the_cache_free_forward_with_vllms_penalties(decode_steps):
    """A logit bias (OpenAI's), then presence, frequency and repetition penalties (vLLM's), as
    tests/reference.penalize applies them to the cache-free forward's logits, give the engine's greedy tokens,
    through the prefill step and k decode steps a readback, each row with its own beside a row with none (whose
    tokens stay the plain greedy ones); they change the output (a test that could not fail otherwise)."""
    m, params = peaky_model("svformer")
    rng = np.random.default_rng(4)
    prompts = prompts_of(rng, 5, m.vocab_size, lo=2, hi=12)
    plain = [model_greedy(m, params, p, 12) for p in prompts]
    ban = ((plain[4][0], -100.0), (plain[4][1], -100.0), (3, 2.5))  # the plain first tokens ruled out
    settings = [(0.0, 0.0, 1.0, ()), (0.0, 2.0, 1.0, ()), (1.5, 0.0, 1.0, ()), (0.5, 0.5, 1.8, ()), (0, 0, 1, ban)]
    # every row prefilled at once, so one row bucket (8) a program: 2 compiles instead of 5
    engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=8, prefill_chunk=16, prefill_rows=8,
                    decode_steps=decode_steps)  # fmt: skip
    params_of = [SamplingParams(max_tokens=12, presence_penalty=p, frequency_penalty=f, repetition_penalty=r,
                                logit_bias=bias) for p, f, r, bias in settings]  # fmt: skip
    got = engine.generate(prompts, params_of)
    changed = 0
    for p, pen, r, base in zip(prompts, settings, got, plain):
        want = model_greedy(m, params, p, 12, penalties=pen)
        assert r.tokens == want, f"penalties {pen}: prompt of {len(p)} tokens"
        changed += want != base
    assert changed >= 3 and got[4].tokens != plain[4], "the penalties changed too little: this test could pass without"
    with pytest.raises(EngineError, match=r"logit_bias names token ids outside the vocabulary"):
        engine.submit([1, 2], SamplingParams(logit_bias=((m.vocab_size, 1.0),)))
    with pytest.raises(EngineError, match=r"min_p=1.5: must be in \[0, 1\]"):
        engine.submit([1, 2], SamplingParams(min_p=1.5))
    with pytest.raises(EngineError, match=r"frequency_penalty=2.5: must be in \[-2, 2\]"):
        engine.submit([1, 2], SamplingParams(frequency_penalty=2.5))
    with pytest.raises(EngineError, match="repetition_penalty=0.0: must be a number > 0"):
        engine.submit([1, 2], SamplingParams(repetition_penalty=0.0))


@pytest.mark.parametrize("decode_steps", fast_few([1, 4], [1]))
def test_masked_greedy_tokens_equal_the_cache_free_forward_with_the_masked_ids_ruled_out(decode_steps):
    """min_tokens (vLLM's): a row's stop ids cannot come before its min_tokens-th new token (the oracle rules them
    out there), the request then ending at its stop id as usual; allowed_token_ids (vLLM's): every id outside them
    ruled out; bad words (vLLM's, as ids): a word's last token ruled out where the rest ends the generated text;
    through the prefill step and k decode steps a readback, beside a row without (plain greedy)."""
    m, params = peaky_model("resformer")
    prompts = prompts_of(np.random.default_rng(6), 3, m.vocab_size, lo=2, hi=12)
    plain = [model_greedy(m, params, p, 10) for p in prompts]
    stop = plain[0][0]  # the first token greedy gives the first prompt
    params_of = [SamplingParams(max_tokens=10, stop_ids=(stop, plain[1][2]), min_tokens=n) for n in (5, 4)]
    params_of.append(SamplingParams(max_tokens=10))
    params_of.append(SamplingParams(max_tokens=10, allowed_token_ids=tuple(range(3, m.vocab_size, 7))))
    words = ((plain[2][1], plain[2][2]), (plain[2][5], plain[2][6], plain[2][7]))  # greedy's own
    params_of.append(SamplingParams(max_tokens=10, bad_words_ids=words))
    prompts += [prompts[2], prompts[2]]
    engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=8, prefill_chunk=16, prefill_rows=8,
                    decode_steps=decode_steps)  # fmt: skip
    got = engine.generate(prompts, params_of)
    for p, s, r in zip(prompts, params_of, got):
        outside = set(range(m.vocab_size)) - set(s.allowed_token_ids) if s.allowed_token_ids else set()

        def early(seq, new, s=s, outside=outside):
            bad = {
                w[-1]
                for w in s.bad_words_ids
                if len(new) >= len(w) - 1 and tuple(new[len(new) - len(w) + 1 :]) == w[:-1]
            }
            return (set(s.stop_ids) if len(new) < s.min_tokens else set()) | outside | bad

        want = model_greedy(m, params, p, 10, banned=early)
        ended = [i for i, t in enumerate(want) if t in s.stop_ids and i >= s.min_tokens]
        assert r.tokens == (want[: ended[0] + 1] if ended else want), f"min_tokens {s.min_tokens}"
    assert got[0].tokens[0] != stop and got[2].tokens == plain[2], "min_tokens masked nothing: the test could pass"
    assert set(got[3].tokens) <= set(params_of[3].allowed_token_ids) and got[3].tokens != plain[2]
    t, g = got[4].tokens, plain[2]  # greedy's own words: its text changed where one would first complete
    first = min(i + len(w) - 1 for w in words for i in range(len(g)) if tuple(g[i : i + len(w)]) == w)
    assert t[:first] == g[:first] and t[first] != g[first], (t, g)
    assert not any(tuple(t[i : i + len(w)]) == w for w in words for i in range(len(t)))


@pytest.mark.slow
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_fifty_requests_through_a_pool_too_small_for_all_arriving_while_others_decode(decode_steps):
    """50 requests of random lengths, 5 new ones arriving every step, through a pool that holds about 4 whole
    sequences: some wait, some are preempted and recomputed; every output is the full forward's greedy one
    (the argmax of its logits), every log-probability the forward's, and the pool ends empty. With
    decode_steps=4, four decode steps run between readbacks."""
    m, params = peaky_model("svformer")
    rng = np.random.default_rng(2)
    prompts = prompts_of(rng, 50, m.vocab_size, 1, 60)
    engine = Engine(
        m, params, cache_bytes=4 * 72 * 1024, page_size=8, max_batch=16, prefill_chunk=16, decode_steps=decode_steps
    )
    assert engine.pool.usable == 35
    params_of = [SamplingParams(max_tokens=int(rng.integers(1, 12))) for _ in prompts]
    queued, reqs = list(zip(prompts, params_of)), []
    while queued or engine.busy:
        for p, s in queued[:5]:
            reqs.append(engine.submit(p, s))
        queued = queued[5:]
        engine.step()
        assert engine.pool.used <= engine.pool.usable
    assert engine.stats.preemptions > 0 and engine.stats.most_concurrent > 1
    forward = jax.jit(lambda t: Transformer(m).apply({"params": params}, t))
    for p, s, r in zip(prompts, params_of, reqs):
        assert len(r.tokens) == s.max_tokens and r.done
        padded = np.zeros((1, 72), np.int32)  # one shape, one compile: a causal model's logits ignore what follows
        padded[0, : len(p) + len(r.tokens)] = p + r.tokens
        logits = np.asarray(forward(jnp.asarray(padded)))[0]
        for i, t in enumerate(r.tokens):
            row = logits[len(p) - 1 + i]
            assert t == int(row.argmax()), f"prompt of {len(p)}, token {i}"
            assert r.logprobs[i] == pytest.approx(float(jax.nn.log_softmax(row)[t]), abs=1e-3)
    assert engine.pool.used == 0 and engine.pool.free == engine.pool.usable
    assert len(engine.stats.compiled_shapes) <= 24  # buckets of rows, tokens and pages, not one per length


def test_stop_ids_and_sampling_are_per_request_and_reproducible():
    m, params = peaky_model("resformer")
    rng = np.random.default_rng(3)
    prompt = prompts_of(rng, 1, m.vocab_size, 5, 6)[0]
    greedy = model_greedy(m, params, prompt, 6)
    engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=8, prefill_chunk=16)
    stop = SamplingParams(max_tokens=6, stop_ids=(greedy[2],))
    hot = SamplingParams(max_tokens=6, temperature=5.0, top_k=50, top_p=0.9, seed=7)
    a, b, c = engine.generate([prompt, prompt, prompt], [stop, hot, hot])
    assert a.tokens == greedy[: greedy.index(greedy[2]) + 1] and a.finish_reason == "stop"
    assert b.tokens == c.tokens  # the same seed samples the same tokens, whatever else is in the batch
    (d,) = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=5.0, top_k=50, top_p=0.9, seed=8))
    assert d.tokens != b.tokens  # another seed, other tokens (temperature 5 over 50 tokens)
    assert engine.pool.used == 0


# slow (over the fast tier's 5 s, cold cache, 2 cores): two engines' decode programs (1 and k steps a readback)
@pytest.mark.slow
def test_k_decode_steps_between_readbacks_give_the_single_steps_tokens():
    """decode_steps=4 (the default is 8): greedy, seeded sampling, a stop id met inside a run of
    steps, max tokens not a multiple of 4, a request that ends at the model's last position, and requests
    arriving while others decode: the same tokens and log-probabilities as one step a readback, the pool empty
    after, and a quarter of the readbacks."""
    m, params = peaky_model("svformer")
    rng = np.random.default_rng(4)
    prompts = prompts_of(rng, 6, m.vocab_size, 3, 30) + [[7] * (m.max_seq_len - 10)]
    greedy = model_greedy(m, params, prompts[0], 9)
    settings = [
        SamplingParams(max_tokens=9, stop_ids=(greedy[5],)),
        SamplingParams(max_tokens=13, temperature=2.0, top_k=20, seed=3),
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=6, temperature=1.0, top_p=0.8, seed=5),
        SamplingParams(max_tokens=11),
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=10),
    ]

    def run(k):
        engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=8, prefill_chunk=64, decode_steps=k)
        reqs = [engine.submit(p, s) for p, s in zip(prompts[:3], settings[:3])]
        engine.step()
        engine.step()  # the first three decoding before the others arrive
        reqs += [engine.submit(p, s) for p, s in zip(prompts[3:], settings[3:])]
        while engine.busy:
            engine.step()
        assert engine.pool.used == 0
        return reqs, engine.stats

    (single, single_stats), (burst, burst_stats) = run(1), run(4)
    for a, b in zip(single, burst):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert burst[0].finish_reason == "stop" and burst[0].tokens == greedy[: greedy.index(greedy[5]) + 1]
    assert len(burst[6].tokens) == 10 and burst[6].finish_reason == "length"  # up to the model's context
    assert burst_stats.decode_rows == single_stats.decode_rows
    assert burst_stats.decode_readbacks <= single_stats.decode_readbacks / 2  # 6 against 12


# slow (over the fast tier's 5 s, cold cache, 2 cores): two engines' decode programs (streaming and batched readbacks)
@pytest.mark.slow
def test_a_streaming_engine_steps_once_a_readback_until_every_row_is_busy():
    """#91: Engine(stream=True), as `serve` builds it: with rows free and nobody waiting each decode step is read
    back (a client sees every token as it is sampled); once every row is busy and requests wait, decode_steps a
    readback. The tokens are those of the engine that always runs decode_steps."""
    m, params = peaky_model("resformer")
    rng = np.random.default_rng(6)
    prompts = prompts_of(rng, 6, m.vocab_size, 3, 20)
    sampling = [SamplingParams(max_tokens=5 + 2 * i, temperature=float(i % 2), seed=i) for i in range(len(prompts))]

    def engine(stream):
        return Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=3, prefill_chunk=64, decode_steps=4,
                      stream=stream)  # fmt: skip

    light = engine(True)
    alone = light.generate(prompts[:2], sampling[:2])  # two rows of three: one step a readback throughout
    assert light.stats.decode_readbacks == light.stats.decode_steps > 0
    busy = engine(True)
    reqs = [busy.submit(p, s) for p, s in zip(prompts, sampling)]  # six for three rows: three wait
    ks = []
    while busy.busy:
        ks.append(busy.steps_a_readback())
        busy.step()
    assert 4 in ks and ks[-1] == 1  # k steps while the load needs them, one again for the last rows
    assert busy.stats.decode_readbacks < busy.stats.decode_steps
    fixed = engine(False)
    want = fixed.generate(prompts, sampling)
    assert [r.tokens for r in reqs] == [r.tokens for r in want] and [r.tokens for r in alone] == [
        r.tokens for r in want[:2]
    ]


def test_a_gpus_step_form_pads_rows_and_the_lm_head_and_gives_the_same_tokens(monkeypatch):
    """A GPU's engine runs one row as two and holds the LM head padded (runner.StepForm, read off the compiled
    step): the same greedy tokens, sampled tokens and log-probabilities as the plain form, the padding's logits
    never sampled. Run here on a CPU with the GPU's shapes, without its XLA:GPU option."""
    from resformer_jax.kernels.names import compiling_for

    with compiling_for("cuda"):
        gpu = runner_module.step_form()
    assert gpu.min_rows == 2 and gpu.vocab_multiple == 128
    assert dict(gpu.compiler_options) == {"xla_gpu_dot_merger_threshold_mb": 0}
    assert runner_module.step_form() == runner_module.StepForm()  # a CPU: as the program is written

    m, params = peaky_model("svformer")
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, m.vocab_size, 11)]
    settings = [SamplingParams(max_tokens=7), SamplingParams(max_tokens=7, temperature=1.0, top_p=0.9, seed=2)]

    def run():
        engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=8, prefill_chunk=16)
        return engine, [engine.generate([prompt], s)[0] for s in settings]  # one row at a time

    plain_engine, plain = run()
    padded_form = runner_module.StepForm(min_rows=2, vocab_multiple=100)
    monkeypatch.setattr(runner_module, "step_form", lambda m=None: padded_form)
    padded_engine, padded = run()
    assert padded_engine.runner.params["lm_head"]["kernel"].shape[-1] == -(-m.vocab_size // 100) * 100 > m.vocab_size
    assert {shape[0] for shape in padded_engine.stats.compiled_shapes} == {2}
    assert {shape[0] for shape in plain_engine.stats.compiled_shapes} == {1}
    for a, b in zip(plain, padded):
        assert a.tokens == b.tokens and max(b.tokens) < m.vocab_size
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)


def test_cancel_frees_pages_at_once():
    m, params = peaky_model("svformer")
    engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=8, prefill_chunk=16)
    r = engine.submit(list(range(1, 30)), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.pool.used > 0
    engine.cancel(r)
    assert engine.pool.used == 0 and r.finish_reason == "cancelled" and not engine.busy


def test_host_parameters_are_placed_on_the_device_once_and_give_the_same_tokens():
    """An export loads as numpy arrays (load_model): held as they came, every step copied all of them to the device
    (the side-by-side's 82M served 1.5x slower a step, and fell behind its load)."""
    m, params = peaky_model("svformer")
    host = jax.tree.map(np.asarray, params)
    engines = [Engine(m, p, cache_bytes=2**22, page_size=8, max_batch=4, prefill_chunk=16) for p in (params, host)]
    leaves = jax.tree.leaves(engines[1].runner.params)
    assert all(isinstance(x, jax.Array) for x in leaves), {type(x).__name__ for x in leaves}
    outs = []
    for engine in engines:
        r = engine.submit(list(range(1, 20)), SamplingParams(max_tokens=6))
        while engine.busy:
            engine.step()
        outs.append(r.tokens)
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    "prompt,params,words",
    [
        ([1] * 200, SamplingParams(max_tokens=4), "exceed the model's context"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens=0"),
        ([1, 2], SamplingParams(max_tokens=-3), "max_tokens=-3"),
        ([1, 2], SamplingParams(temperature=-1.0), "temperature=-1.0"),
        ([], SamplingParams(), "prompt is empty"),
        ([1, 10**6], SamplingParams(), "outside the vocabulary"),
    ],
)
def test_bad_requests_are_named(prompt, params, words):
    m, p = peaky_model("none")
    engine = Engine(m, p, cache_bytes=2**22, page_size=8)
    with pytest.raises(EngineError, match=words.replace("(", r"\(")):
        engine.submit(prompt, params)
    assert not engine.busy


def test_a_cache_smaller_than_one_sequence_is_named():
    m, p = peaky_model("none")
    with pytest.raises(EngineError, match="less than one page"):
        Engine(m, p, cache_bytes=100, page_size=8)
    engine = Engine(m, p, cache_bytes=3 * 8 * 1536, page_size=8)  # two usable pages: 16 tokens
    with pytest.raises(EngineError, match="raise the cache budget or lower max_tokens"):
        engine.submit([1] * 10, SamplingParams(max_tokens=10))


# slow (over the fast tier's 5 s, cold, 2 cores): the paged kernel's and the gather path's programs, interpreted
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["none", "svformer+gqa"])
def test_paged_kernel_reads_pages_in_place_and_equals_the_gather_path(variant):
    """A GPU run's engine (attention_impl=pallas) decodes through JAX's Pallas paged_attention, which reads each
    row's pages where they lie (kernels/paged_attention.py; interpreted here): the decode step's program holds the
    kernel and no gather of the pool, and its greedy tokens are the cache-free forward's."""
    from resformer_jax.engine.runner import step_program, step_shapes

    m, params = peaky_model(variant.split("+")[0], **VARIANTS.get(variant, {}))
    m = m.replace(attention_impl="pallas")
    engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=4, prefill_chunk=16)
    jaxpr = str(
        jax.make_jaxpr(step_program(engine.runner.model))(
            engine.runner.params, engine.runner.cache, *step_shapes(engine.runner.model, 4, 1, 8)
        )
    )
    assert "paged_attention" in jaxpr, "the decode step does not call the paged kernel"
    prompts = prompts_of(np.random.default_rng(5), 4, m.vocab_size)
    got = engine.generate(prompts, SamplingParams(max_tokens=6))
    for p, r in zip(prompts, got):
        assert r.tokens == model_greedy(m, params, p, 6), f"{variant}: prompt of {len(p)} tokens"
    assert engine.pool.used == 0


def test_blocked_paged_attention_equals_dense_attention_over_ragged_rows():
    """The CPU's paged decode attention (a loop over blocks of pages, online softmax) against softmax attention over
    each row's own tokens, for rows of ragged lengths whose pages lie scattered in the pool, GQA included; the loop
    stops at the longest row, so pages past it may hold anything."""
    from resformer_jax.kernels.paged_attention import blocked_decode_attention

    rng = np.random.default_rng(0)
    K, H, D, page, N = 2, 4, 8, 4, 40
    k_pool, v_pool = (jnp.asarray(rng.normal(size=(K, N, page, D)), jnp.float32) for _ in range(2))
    lengths = np.array([1, 5, 17, 30])
    table = np.zeros((4, 8), np.int32)
    table[:] = rng.permutation(N)[:32].reshape(4, 8)
    q = jnp.asarray(rng.normal(size=(4, H, D)), jnp.float32)
    pages_major = lambda x: x.transpose(1, 2, 0, 3).reshape(N, page, K * D)  # the TPU's layout ('lanes')
    for layout, block_bytes in itertools.product((lambda x: x, pages_major), (1, 2**20)):  # one page a block, all
        got = np.asarray(
            blocked_decode_attention(
                q, layout(k_pool), layout(v_pool), table, jnp.asarray(lengths), block_bytes=block_bytes
            )
        )
        for b, n in enumerate(lengths):
            idx = [(table[b, s // page], s % page) for s in range(n)]
            k = np.stack([np.asarray(k_pool)[:, p, o] for p, o in idx], 1)  # [K, n, D]
            v = np.stack([np.asarray(v_pool)[:, p, o] for p, o in idx], 1)
            for h in range(H):
                s_ = k[h // (H // K)] @ np.asarray(q)[b, h] / np.sqrt(D)
                w = np.exp(s_ - s_.max())
                want = (w / w.sum()) @ v[h // (H // K)]
                np.testing.assert_allclose(got[b, h], want, rtol=1e-5, atol=1e-5, err_msg=f"row {b} head {h}")


def test_skip_prefill_puts_every_request_in_decode_with_its_pages():
    """bench decode --prefill=false: the prompts' pages taken, the requests decoding at the next step."""
    m, p = peaky_model("svformer")
    engine = Engine(m, p, cache_bytes=2**22, page_size=8, max_batch=4)
    reqs = [engine.submit([1] * n, SamplingParams(max_tokens=3)) for n in (5, 20, 9)]
    engine.skip_prefill()
    assert [r.state for r in reqs] == ["decode"] * 3
    assert [len(r.pages) for r in reqs] == [1, 3, 2] and [r.cached for r in reqs] == [5, 20, 9]
    while engine.busy:
        engine.step()
    assert engine.stats.prefill_steps == 0 and all(len(r.tokens) == 3 for r in reqs) and engine.pool.used == 0


# slow (over the fast tier's 5 s, cold cache, 2 cores): compiles the engine's programs for an 8-device mesh
@pytest.mark.slow
def test_the_engine_on_a_mesh_gives_the_single_device_tokens():
    """On 8 host devices as data 4 x fsdp 2: each device runs its rows over its own pages (the cache split over
    the mesh), the parameters replicated, then left sharded by the training rule table; requests of mixed lengths
    arriving while others decode, through pools small enough to preempt, four decode steps a readback, give the
    single-device greedy tokens (one step a readback, computed once for both placements)."""
    from jax.sharding import Mesh

    from resformer_jax.parallel.mesh import logical_shardings

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py sets it)")
    m, params = peaky_model("svformer", num_kv_heads=2)
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))
    boxed = Transformer(m).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    sharded = jax.device_put(params, nn.unbox(logical_shardings(boxed, mesh, tiny_config("svformer").mesh)))
    assert not all(x.sharding.is_fully_replicated for x in jax.tree.leaves(sharded))
    rng = np.random.default_rng(3)
    prompts = prompts_of(rng, 32, m.vocab_size, 10, 40)
    # every other request with penalties: the penalized programs run per shard too
    sampling = [SamplingParams(max_tokens=6, frequency_penalty=1.5 * (i % 2), repetition_penalty=1 + (i % 4 == 1))
                for i in range(len(prompts))]  # fmt: skip
    one = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=16, prefill_chunk=16, decode_steps=1)
    want = [r.tokens for r in one.generate(prompts, sampling)]
    for params_as, placed in (("replicated", params), ("sharded as in training", sharded)):
        # 7 usable pages of 8 tokens a device: a sequence takes up to 6, two rows a device must preempt
        engine = Engine(
            m, placed, cache_bytes=8 * 8 * 512, page_size=8, max_batch=16, prefill_chunk=16, decode_steps=4, mesh=mesh
        )
        assert engine.bytes_per_token == 512 and engine.pool[0].usable == 7
        pool = jax.tree.leaves(engine.runner.cache)[0]
        assert pool.addressable_shards[0].data.shape[1] == engine.pool[0].num_pages, "the pages are not split"
        reqs = arrive_while_decoding(engine, prompts, sampling, 8)
        assert [r.tokens for r in reqs] == want, params_as
        assert len({r.shard for r in reqs}) >= 4, f"{params_as}: the rows were not spread over the devices"
        assert engine.stats.preemptions > 0, params_as
        assert engine.pool.used == 0, params_as


def _paged_reference(q, k_pool, v_pool, table, lengths, K):
    """softmax attention of each row's query over its first lengths[b] tokens, read from a pages-major pool."""
    page, D = k_pool.shape[1], q.shape[-1]
    B, H = q.shape[:2]
    out = np.zeros((B, H, D))
    for b, n in enumerate(lengths):
        rows = [(table[b, s // page], s % page) for s in range(n)]
        k = np.stack([k_pool[p, o].reshape(K, D) for p, o in rows], 1).astype(np.float64)  # [K, n, D]
        v = np.stack([v_pool[p, o].reshape(K, D) for p, o in rows], 1).astype(np.float64)
        for h in range(H):
            s_ = k[h // (H // K)] @ q[b, h].astype(np.float64) / np.sqrt(D)
            w = np.exp(s_ - s_.max())
            out[b, h] = (w / w.sum()) @ v[h // (H // K)]
    return out


@pytest.mark.parametrize("variant", fast_few(["none", "svformer"], ["svformer"]))
def test_a_bf16_engine_on_a_cpu_multiplies_the_rounded_weights_in_fp32(variant):
    """On a CPU a bf16 model's engine holds its weights rounded to bf16 once, stored as fp32, and multiplies them
    in fp32 ("rounded" matmuls: XLA:CPU's bf16 matrix-vector products made one row's step 7x slower): the
    logits equal the bf16 model's own forward (fp32 masters cast per matmul) within bf16 rounding."""
    from resformer_jax.engine.runner import serving_params
    from resformer_jax.resolve import serving_model

    c = tiny_config(variant)
    c.model.dtype = "bfloat16"
    m = for_backend(ModelConfig.of(c.model)).replace(matmuls="cpu")
    params = nn.unbox(Transformer(m).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
    served = serving_model(m)
    assert served.matmuls == "rounded" and not served.scan_layers
    held = serving_params(served, params)
    for x in jax.tree.leaves(held):
        assert x.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(x), np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, m.vocab_size, (2, 40)))
    want = np.asarray(jax.jit(Transformer(m).apply)({"params": params}, tokens), np.float32)
    got = np.asarray(jax.jit(Transformer(served).apply)({"params": held}, tokens), np.float32)
    np.testing.assert_allclose(got, want, atol=4 * 2**-8 * np.abs(want).max())
    engine = Engine(m, params, cache_bytes=2**20, page_size=8, max_batch=2, prefill_chunk=16)
    assert engine.model_cfg.matmuls == "rounded"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16 bits"])
@pytest.mark.parametrize("rows,D", [(5, 64), (2, 64), (1, 24)])
def test_native_paged_attention_equals_dense_attention_over_ragged_rows(dtype, rows, D):
    """The native CPU decode attention (kernels/cpu_paged_attention.cc) against fp64 softmax attention over each
    row's own tokens: rows of ragged lengths (one token, a page's worth, a partial last page) whose pages lie
    scattered in the pool, GQA, fp32 and bf16 pools, a head_dim with a remainder of 8, one row or two (cut into
    runs of pages over the threads, their softmaxes combined; the one-token row's second run empty), and bf16
    stored as its bits (uint16, paged_attention.pool_dtype). Pages past a row's length hold garbage and must not
    be read."""
    from resformer_jax.kernels import cpu_paged_attention

    if not cpu_paged_attention.available():
        pytest.skip("the native CPU kernel could not be built here (no C++ compiler): XLA's loop runs instead")
    rng = np.random.default_rng(0)
    K, H, page, N = 2, 8, 4, 64
    k_pool, v_pool = (rng.normal(size=(N, page, K * D)).astype(np.float32) for _ in range(2))
    k_pool[0] = v_pool[0] = np.nan  # page 0 is never any row's, and is named past each row's length
    lengths = np.array([30, 1, 4, 17, 9][:rows])
    table = np.zeros((rows, 8), np.int32)
    for b, n in enumerate(lengths):
        table[b, : -(-n // page)] = rng.permutation(np.arange(1, N))[: -(-n // page)]
    q = rng.normal(size=(rows, H, D)).astype(np.float32)
    pools = [jnp.asarray(x, dtype.split()[0]) for x in (k_pool, v_pool)]
    stored = [jax.lax.bitcast_convert_type(x, jnp.uint16) for x in pools] if "bits" in dtype else pools
    got = jax.jit(cpu_paged_attention.paged_decode_attention)(jnp.asarray(q), *stored, table, jnp.asarray(lengths))
    want = _paged_reference(q, *(np.asarray(x, np.float32) for x in pools), table, lengths, K)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_native_paged_attention_refuses_a_page_outside_the_pool():
    """A page table naming a page past the pool's end is an error from the kernel, never a read out of bounds."""
    from resformer_jax.kernels import cpu_paged_attention

    if not cpu_paged_attention.available():
        pytest.skip("the native CPU kernel could not be built here (no C++ compiler): XLA's loop runs instead")
    pool = jnp.zeros((4, 4, 16), jnp.float32)
    table = jnp.asarray([[1, 9]], jnp.int32)  # page 9 of 4, inside the row's 6 tokens
    with pytest.raises(Exception, match="reads page 9 of a pool of 4"):
        cpu_paged_attention.paged_decode_attention(jnp.ones((1, 2, 16)), pool, pool, table, jnp.asarray([6]))
    # the same table for a row of 4 tokens reads only page 1: no error
    cpu_paged_attention.paged_decode_attention(jnp.ones((1, 2, 16)), pool, pool, table, jnp.asarray([4]))


def test_cpu_decode_kernel_choice(monkeypatch):
    """On a CPU the engine's pools are the native kernel's (pages-major) when it builds; RESFORMER_NATIVE_KERNELS=0,
    or a head_dim the kernel does not take, gives XLA's loop over heads-major pools."""
    from resformer_jax.kernels import cpu_paged_attention, paged_attention

    want = "native" if cpu_paged_attention.available() else "blocks"
    assert paged_attention.kernel_for("xla", 64) == want
    assert paged_attention.kernel_for("xla", 12) == "blocks"
    monkeypatch.setenv("RESFORMER_NATIVE_KERNELS", "0")
    cpu_paged_attention.load.cache_clear()
    try:
        assert paged_attention.kernel_for("xla", 64) == "blocks"
    finally:
        cpu_paged_attention.load.cache_clear()


@pytest.mark.parametrize("kernel", ["native", "blocks"])
def test_a_bf16_pool_on_cpu_holds_its_bits_and_reads_back_its_values(kernel):
    """bf16 pools of the CPU's kernels are stored as uint16 bits (XLA:CPU's bf16 scatter converted the whole pool
    to fp32 and back every write): tokens written read back bit-exact through the gather, and XLA's loop over the
    bits gives the values' attention."""
    from resformer_jax.kernels import paged_attention as pa

    assert pa.pool_dtype(kernel, "bfloat16") == jnp.uint16 and pa.pool_dtype("gpu", "bfloat16") == jnp.bfloat16
    assert pa.pool_dtype(kernel, "float32") == jnp.float32
    rng = np.random.default_rng(1)
    K, D, page, N = 2, 16, 4, 6
    pool = jnp.zeros(pa.pool_shape(kernel, K, N, page, D), jnp.uint16)
    cur = jnp.asarray(rng.normal(size=(1, 6, K, D)), jnp.bfloat16)
    pages, offsets = jnp.asarray([[3, 3, 3, 3, 1, 1]]), jnp.asarray([[0, 1, 2, 3, 0, 1]])
    pool = pa.write_tokens(pool, pages, offsets, cur, kernel)
    assert pool.dtype == jnp.uint16
    got = pa.gather_pages(pool, jnp.asarray([[3, 1]]), kernel, K)[:, :6]
    assert got.dtype == jnp.bfloat16 and np.array_equal(np.asarray(got, np.float32), np.asarray(cur, np.float32))
    if kernel == "blocks":
        q = jnp.asarray(rng.normal(size=(1, 4, D)), jnp.float32)
        values = jax.lax.bitcast_convert_type(pool, jnp.bfloat16)
        args = (jnp.asarray([[3, 1]], jnp.int32), jnp.asarray([6]))
        np.testing.assert_allclose(
            np.asarray(pa.blocked_decode_attention(q, pool, pool, *args)),
            np.asarray(pa.blocked_decode_attention(q, values, values, *args)),
            rtol=1e-6,
        )


def test_time_per_output_token_spans_first_to_last_token_whatever_the_bursts():
    """k decode steps a readback hand a row k tokens at once: most inter-token gaps are 0, and the time per output
    token (first token to last, a token) is the pace a reader sees."""
    from resformer_jax.engine.engine import Request

    r = Request(id=0, prompt=[1], params=SamplingParams(), submitted_s=0.5, token_times_s=[1.0, 1.0, 1.0, 2.0, 2.0])
    assert r.inter_token_s == [0.0, 0.0, 1.0, 0.0]
    assert r.time_per_output_token_s == 0.25 and r.time_to_first_token_s == 0.5
    assert Request(id=1, prompt=[1], params=SamplingParams(), token_times_s=[1.0]).time_per_output_token_s is None


# ---------------------------------------------------------------------------------------------- the prefix cache


def _shared_prefix_prompts(rng, vocab, prefixes=3, per_prefix=4, prefix_len=37, suffix=(1, 12)):
    heads = [[int(t) for t in rng.integers(0, vocab, prefix_len)] for _ in range(prefixes)]
    return [
        heads[i % prefixes] + [int(t) for t in rng.integers(0, vocab, int(rng.integers(*suffix)))]
        for i in range(prefixes * per_prefix)
    ]


# slow (over the fast tier's 5 s, cold cache, 2 cores): two engines (prefix cache on and off) through an eviction load
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["none", "svformer", "skipv1"])
def test_prefix_cache_outputs_equal_the_cache_off_run_under_eviction(variant):
    """#75: prompts sharing prefixes, through a pool so small that cached pages are evicted and requests preempted:
    greedy tokens equal and log-probabilities within 1e-5 of the same engine with the prefix cache off; the hits
    are counted in tokens, fewer prompt tokens are computed, and the pool ends with nothing held."""
    m, params = peaky_model(variant, **VARIANTS[variant])
    prompts = _shared_prefix_prompts(np.random.default_rng(3), m.vocab_size)
    runs = {}
    for on in (False, True):
        engine = Engine(m, params, cache_bytes=14 * 8 * _bytes(m), page_size=8, max_batch=6, prefill_chunk=16,
                        prefix_cache=on)  # fmt: skip
        runs[on] = (engine, engine.generate(prompts, SamplingParams(max_tokens=10)))
    (off, want), (on, got) = runs[False], runs[True]
    for w, g in zip(want, got):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    assert on.stats.prefix_hits >= 8 * 4 and on.stats.prefix_queries >= sum(len(p) for p in prompts)
    assert on.stats.prefill_tokens < off.stats.prefill_tokens - on.stats.prefix_hits // 2
    assert off.stats.prefix_hits == 0
    assert on.pool.used == 0 and on.pool[0].cached > 0  # cached pages stay, idle, held by no one


def _bytes(m):
    from resformer_jax.model.transformer import cache_bytes_per_token

    return cache_bytes_per_token(m)


# slow (over the fast tier's 5 s, cold cache, 2 cores): two engines (prefix cache on and off)
@pytest.mark.slow
def test_a_shared_page_is_freed_only_when_both_requests_end_and_a_half_prefilled_page_is_never_cached():
    """#75: two live requests with one prefix hold the same pages (two holders each); the first to end leaves them
    held; after both they stay cached, idle. A request cancelled mid-prefill leaves only the pages it filled
    completely as blocks: the next request with that prompt reuses exactly those and gives the cache-off tokens."""
    m, params = peaky_model("svformer")
    rng = np.random.default_rng(5)
    prefix = [int(t) for t in rng.integers(0, m.vocab_size, 24)]  # 3 full pages of 8
    engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=4, prefill_chunk=16)
    a = engine.submit(prefix + [1, 2], SamplingParams(max_tokens=40))
    while a.cached < len(a.prompt):  # its prompt read: its 3 full pages are blocks
        engine.step()
    b = engine.submit(prefix + [3], SamplingParams(max_tokens=90))
    engine.step()
    assert a.pages[:3] == b.pages[:3] and all(engine.pool[0].holders[p] == 2 for p in a.pages[:3])
    assert engine.stats.prefix_hits == 24
    while not a.done:
        engine.step()
    assert not b.done and all(engine.pool[0].holders[p] == 1 for p in b.pages[:3])
    shared = b.pages[:3]
    while engine.busy:
        engine.step()
    assert engine.pool.used == 0 and all(p in engine.pool[0]._idle for p in shared)

    long = [int(t) for t in rng.integers(0, m.vocab_size, 40)]
    c = engine.submit(long, SamplingParams(max_tokens=4))
    engine.step()  # one prefill chunk of 16 tokens: pages 0 and 1 full, nothing more
    assert c.cached == 16 and len(c.blocks) == 2
    engine.cancel(c)
    hits = engine.stats.prefix_hits
    (d,) = engine.generate([long], SamplingParams(max_tokens=4))
    assert engine.stats.prefix_hits - hits == 16  # the two full pages, not the half-written third
    off = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=4, prefill_chunk=16, prefix_cache=False)
    assert d.tokens == off.generate([long], SamplingParams(max_tokens=4))[0].tokens


# slow (over the fast tier's 5 s, cold, 2 cores): scoring with the prefix cache on and off, and the whole forward
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["none", "svformer", "resformer"])
def test_prompt_and_token_scores_equal_the_whole_forward_with_the_prefix_cache_on_or_off(variant):
    """#75: what echo and logprobs return, read in the engine's prefill and decode steps: each prompt token's
    log-probability and its 20 most likely alternatives equal the cache-free whole-sequence forward's (fp32,
    within 1e-5; ids equal), with prompts sharing prefixes served from cached blocks (which keep their scores),
    chunks of 16 crossing pages of 8, and a request of 0 new tokens scoring its prompt only."""
    m, params = peaky_model(variant, **VARIANTS[variant])
    prompts = _shared_prefix_prompts(np.random.default_rng(7), m.vocab_size, prefixes=2, per_prefix=3)
    model = Transformer(m)
    forward = jax.jit(lambda tokens: jax.nn.log_softmax(model.apply({"params": params}, tokens)[0], -1))

    def whole(ids):  # log p at every position of ids (row t predicts token t + 1), the cache-free forward
        return np.asarray(forward(jnp.array([ids])))

    runs = {}
    for on in (False, True):
        engine = Engine(m, params, cache_bytes=2**22, page_size=8, max_batch=4, prefill_chunk=16, prefix_cache=on)
        asks = [SamplingParams(max_tokens=0 if i % 2 else 5, logprobs=3, prompt_logprobs=3) for i in range(6)]
        runs[on] = (engine, engine.generate(prompts, asks))
    assert runs[True][0].stats.prefix_hits >= 2 * 2 * 32  # the later requests of each prefix: 4 full pages
    for on, (engine, got) in runs.items():
        for p, r in zip(prompts, got):
            ids = p + r.tokens
            logp = whole(ids)
            assert r.scores.logprob[0] is None and len(r.tokens) == (0 if r.params.max_tokens == 0 else 5)
            for i in range(1, len(ids)):
                want = np.argsort(-logp[i - 1])[:20]
                top_ids, top_lps = r.scores.top[i]
                # logits of up to ~50 (the scaled head): fp32 round-off relative to them
                np.testing.assert_allclose(r.scores.logprob[i], logp[i - 1, ids[i]], rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(top_lps, logp[i - 1, want], rtol=1e-5, atol=1e-5)
                assert list(top_ids[:3]) == list(want[:3]), f"prefix cache {on}, position {i}"
        assert engine.pool.used == 0
    for off, on in zip(runs[False][1], runs[True][1]):  # the bar: the cache changes nothing past 1e-5
        assert on.tokens == off.tokens
        np.testing.assert_allclose(on.scores.logprob[1:], off.scores.logprob[1:], atol=1e-5)


def test_output_text_equals_the_whole_decode_and_ends_at_the_first_stop_string(shared_data):
    """vLLM's incremental detokenization over the NeoX tokenizer: the text added token by token is the whole
    output's decode (multi-byte characters split across byte tokens included); a stop string that spans tokens ends
    the text at the token that completes it (before it; through it with include_stop_str_in_output); the deltas
    never show a character a stop string may still begin with, and with the rest they add up to the text; a stop
    string completed before min_tokens (stopping off) is not found later, as vLLM searches only new text."""
    from tokenizers import Tokenizer

    from resformer_jax.engine.detokenizer import OutputText

    tok = Tokenizer.from_file(str(shared_data / "tokenizers" / "gpt-neox-20b.json"))
    text = "def f(x):\n    return x  # é, 値, 🙂 and a stop: END.\n\nnext"
    ids = tok.encode(text).ids
    assert len(ids) > len(text) // 4 and any(tok.decode([t]).endswith("\ufffd") for t in ids)  # split characters
    plain = OutputText(tok.decode)
    for i, t in enumerate(ids):
        plain.add(t)
        assert tok.decode(ids[: i + 1]).startswith(plain.text)
    assert plain.text == tok.decode(ids) == text
    end = next(i for i in range(len(ids)) if "END" in tok.decode(ids[: i + 1]))
    blank = next(i for i in range(len(ids)) if "\n\n" in tok.decode(ids[: i + 1]))
    for keep, want in ((False, text[: text.index("END")]), (True, text[: text.index("END") + 3])):
        out, sent = OutputText(tok.decode, ["END", "\n\n"], keep), ""
        for i, t in enumerate(ids):
            if out.add(t):
                assert i == end, "the stop string ended the text at another token than the one completing it"
                break
            delta = out.delta()
            assert not delta.endswith(("E", "EN", "\n")), "a stop string's first characters were sent"
            sent += delta
        assert out.stopped and out.text == want and sent + out.delta(final=True) == want
    late = OutputText(tok.decode, ["END", "\n\n"])
    stopped_at = next(i for i, t in enumerate(ids) if late.add(t, stopping=i > end))
    assert stopped_at == blank and late.text == text[: text.index("\n\n")]


def test_stop_strings_end_a_request_in_the_engine_streamed_or_not():
    """The engine applies a request's stop strings (vLLM's `stop`): its text ends before the first one met from
    min_tokens on, its reason is "stop", no token is generated after the one that completed it, and its pages go
    back; the text deltas its callback gets, with the end's rest, add up to that text; include_stop_str_in_output
    keeps the stop string; a stop string met before min_tokens does not end it."""
    m, params = peaky_model("svformer")
    letters = "abcdefghijklmnopqrstuvwxyz"

    def decode(ids):  # a stand-in tokenizer: one letter a token
        return "".join(letters[t % 26] for t in ids)

    prompt = [5, 9, 2, 7]
    sizes = {"cache_bytes": 2**22, "page_size": 8, "max_batch": 4, "prefill_chunk": 16, "decode_steps": 1}
    engine = Engine(m, params, **sizes, detokenize=decode)
    free = engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    text = decode(free.tokens)
    assert free.text == text and free.finish_reason == "length"
    at = 6  # a two-letter stop string first completed by the 8th token
    stop = next(text[j : j + 2] for j in range(at, len(text) - 2) if text[j : j + 2] not in text[: j + 1])
    first = text.index(stop)
    for keep in (False, True):
        deltas: list[str] = []

        def on_output(r, out, deltas=deltas):
            deltas.append(out.text)

        asked = SamplingParams(max_tokens=24, stop=(stop,), include_stop_str_in_output=keep)
        r = engine.submit(prompt, asked, on_output)
        while engine.busy:
            engine.step()
        assert r.finish_reason == "stop" and len(r.tokens) == first + 2 and r.tokens == free.tokens[: first + 2]
        assert r.text == text[: first + 2 * keep] == "".join(deltas)
        assert engine.pool.used == 0
    early = text[1:3]  # met at the third token: before min_tokens it does not count
    r = engine.generate([prompt], SamplingParams(max_tokens=24, stop=(early,), min_tokens=4))[0]
    later = text.find(early, 2)  # ending at the fourth token or later
    assert r.text == (text[:later] if later >= 0 else text)
    with pytest.raises(EngineError, match="no tokenizer"):
        Engine(m, params, cache_bytes=2**22, page_size=8).submit(prompt, SamplingParams(stop=("ab",)))


@pytest.mark.slow  # 20 programs compiled, twice
def test_after_compile_all_a_mixed_load_compiles_nothing_and_gives_the_same_tokens():
    """#91: compile_all compiles (and runs once, on padding rows) every program plain requests can need (every
    row, token, page and k bucket up to max_batch and the context); then requests of every length up to the
    context, greedy and sampled, arriving while others decode through a pool small enough to preempt, run no
    program it did not compile, and give the tokens of an engine that compiled as it went."""
    m, params = peaky_model("svformer")
    rng = np.random.default_rng(5)
    prompts = prompts_of(rng, 24, m.vocab_size, 1, m.max_seq_len - 24)
    sampling = [SamplingParams(max_tokens=int(n), temperature=float(i % 2), seed=i)
                for i, n in enumerate(rng.integers(1, 24, size=len(prompts)))]  # fmt: skip

    def serve(engine):
        return [r.tokens for r in arrive_while_decoding(engine, prompts, sampling, 6)]

    # a pool of 10 pages: one sequence of the full context takes 8, so two long rows preempt
    sizes = dict(cache_bytes=10 * 16 * cache_bytes_per_token(m), page_size=16, max_batch=2, prefill_chunk=64,
                 prefill_rows=2, decode_steps=4)  # fmt: skip
    warm = Engine(m, params, **sizes)
    shapes = warm.program_shapes()
    warm.compile_all()
    assert warm.compiles_after_start == 0 and len(warm.runner.programs) == len(shapes)
    # a CPU's one-token steps read pages up to each row's length: they run at the full context's table width alone
    assert warm.runner.form.decode_table_full
    want = {(B, T, Pn, 1) for B in (1, 2) for Pn in (4, 8) for T in (16, 64)}
    want |= {(B, 1, 8, k) for B in (1, 2) for k in (1, 2, 4)}
    assert sorted(shapes) == sorted(want)
    got = serve(warm)
    assert warm.stats.preemptions > 0, "the pool never ran short: the test does not reach preemption"
    assert warm.compiles_after_start == 0, warm.runner.programs
    cold = Engine(m, params, **sizes)
    cold.runner.form = dataclasses.replace(cold.runner.form, decode_table_full=False)  # a table width per bucket
    assert serve(cold) == got
    assert {Pn for _, T, Pn, _ in cold.stats.compiled_shapes if T == 1} == {4, 8}  # both widths met, same tokens
    assert cold.compiles_after_start > 0  # the counter counts the programs a cold engine compiled as it served
    # Eq. 2's one-token steps gather every page of the table
    cross = dataclasses.replace(m, value_residual="resformer", mapping="cross_layer")
    assert not runner_module.step_form(cross).decode_table_full
    logprobs = warm.generate([prompts[0]], SamplingParams(max_tokens=2, logprobs=2))
    assert len(logprobs[0].tokens) == 2 and warm.compiles_after_start >= 1  # a variant compile_all leaves out
    # its second token came from a one-step decode (k = 1, the step program): its top ids read as a k-step's are
    for at in (len(prompts[0]), len(prompts[0]) + 1):
        ids, lps = logprobs[0].scores.top[at]
        assert ids.shape == lps.shape == (20,) and ids[0] == logprobs[0].tokens[at - len(prompts[0])], at
