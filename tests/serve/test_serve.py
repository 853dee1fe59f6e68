"""`resformer serve` on a tiny trained run, driven by the official openai client and raw HTTP: greedy text equals
the model's own, streaming equals non-streaming, concurrent clients get their single-request outputs, a client
that goes away frees its pages, a small cache queues instead of failing, bad input is a 400 and the server goes on,
SIGTERM lets the streams in flight finish."""

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from commands import run_command

# a trained run and server processes; one worker runs this file, so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve")]

for module in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
    pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[serve,test]'; CI installs it)")

import httpx  # noqa: E402
import openai  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`resformer serve` in a subprocess. compile_at_start off unless asked (the test that asks checks it): the
    others' requests compile what they need, as the first requests of a server without it do."""

    def __init__(self, workdir, *flags, compile_at_start=False):
        self.port = free_port()
        flags = (*flags, f"--compile_at_start={str(compile_at_start).lower()}")
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "resformer_jax", "serve", f"--workdir={workdir}", f"--port={self.port}", *flags],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
            if self.proc.poll() is not None:
                raise AssertionError(self.proc.stdout.read())
        raise AssertionError("the server did not come up in 180 s")

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
        assert m, f"{name} not in /metrics:\n{text[:2000]}"
        return float(m.group(1))

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.stdout.read()


CHAT_TEMPLATE = "\n".join(
    [
        "{% for m in messages %}{{ m.role }}: {{ m.content }}",
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    ]
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from demo_runs import tokenized_tiny_config

    from resformer_jax.commands.training import run

    wd = str(tmp_path_factory.mktemp("served"))
    assert run(tokenized_tiny_config(steps=30), wd) == 0
    return wd


@pytest.fixture(scope="module")
def server(run_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    s = Server(run_dir, "--cache_gib=0.05", "--max_batch=32", f"--chat_template={template}")
    yield s
    s.stop()


PROMPTS = ["def main():", "import os\nimport sys\n", "class Cache:\n    def __init__(self", "x", "for i in range(10):"]


def greedy(client, prompt, n=12, **kw):
    r = client.completions.create(model=None, prompt=prompt, max_tokens=n, temperature=0, **kw)
    return r.choices[0]


def test_greedy_text_equals_the_models_own_and_streaming_equals_it(server, run_dir):
    from reference import model_greedy

    from resformer_jax.load import load_run
    from resformer_jax.rundir import RunDir

    cfg, params, _ = load_run(run_dir)
    tok = RunDir(run_dir).tokenizer()
    eot = tok.token_to_id("<|endoftext|>")
    client = server.client()
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt, add_special_tokens=False).ids
        new = model_greedy(cfg.model, params, ids, 12, eos_id=eot)
        new = new[: new.index(eot)] if eot in new else new
        choice = greedy(client, prompt)
        assert choice.text == tok.decode(new), prompt
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(model=None, prompt=prompt, max_tokens=12, temperature=0, stream=True)
            if c.choices
        )
        assert streamed == choice.text
    ids_choice = greedy(client, tok.encode(PROMPTS[0], add_special_tokens=False).ids)
    assert ids_choice.text == greedy(client, PROMPTS[0]).text  # token ids as the prompt
    models = client.models.list()
    assert [m.id for m in models.data] == [os.path.basename(run_dir)]


def test_the_openai_sdks_penalties_are_applied_as_vllm_applies_them(server, run_dir):
    """presence_penalty and frequency_penalty as the openai SDK sends them, repetition_penalty in extra_body (as
    vLLM takes it): the text is the cache-free greedy one under vLLM's penalties (tests/reference.penalize), not
    the plain greedy text."""
    from reference import model_greedy

    from resformer_jax.load import load_run
    from resformer_jax.rundir import RunDir

    cfg, params, _ = load_run(run_dir)
    tok = RunDir(run_dir).tokenizer()
    eot = tok.token_to_id("<|endoftext|>")
    client = server.client()
    changed = 0
    for prompt, (presence, frequency, repetition) in zip(PROMPTS, [(0.0, 1.5, 1.0), (1.0, 0.5, 1.3), (2.0, 0, 2.0)]):
        ids = tok.encode(prompt, add_special_tokens=False).ids
        new = model_greedy(cfg.model, params, ids, 12, eos_id=eot, penalties=(presence, frequency, repetition))
        new = new[: new.index(eot)] if eot in new else new
        kw = dict(presence_penalty=presence, frequency_penalty=frequency, extra_body={"repetition_penalty": repetition})
        assert greedy(client, prompt, **kw).text == tok.decode(new), prompt
        changed += greedy(client, prompt).text != tok.decode(new)
    assert changed, "no penalty changed the text: this test would pass without them"


def test_the_openai_sdks_logit_bias_and_vllms_min_p_are_applied(server, run_dir):
    """logit_bias as the openai SDK sends it (token ids as strings, clipped to [-100, 100]) gives the cache-free
    greedy text under that bias (tests/reference.penalize), not the plain one; min_p=1 in extra_body (vLLM's) keeps
    only the most likely token, so sampling at temperature 1.5 gives the greedy text."""
    from reference import model_greedy

    from resformer_jax.load import load_run
    from resformer_jax.rundir import RunDir

    cfg, params, _ = load_run(run_dir)
    tok = RunDir(run_dir).tokenizer()
    eot = tok.token_to_id("<|endoftext|>")
    client = server.client()
    prompt = PROMPTS[0]
    ids = tok.encode(prompt, add_special_tokens=False).ids
    plain = model_greedy(cfg.model, params, ids, 12, eos_id=eot)
    bias = {str(plain[0]): -500, str(plain[1]): -100}  # -500 is clipped to -100
    ruled_out = [(plain[0], -100), (plain[1], -100)]
    new = model_greedy(cfg.model, params, ids, 12, eos_id=eot, penalties=(0, 0, 1, ruled_out))
    new = new[: new.index(eot)] if eot in new else new
    got = greedy(client, prompt, logit_bias=bias).text
    assert got == tok.decode(new) and got != greedy(client, prompt).text, (got, tok.decode(new))
    r = client.completions.create(model=None, prompt=prompt, max_tokens=12, temperature=1.5, seed=3,
                                  extra_body={"min_p": 1.0})  # fmt: skip
    assert r.choices[0].text == greedy(client, prompt).text


def test_vllms_allowed_token_ids_through_the_openai_sdk_streamed_and_not(server, run_dir):
    """allowed_token_ids in extra_body (vLLM's): 64 tokens sampled at temperature 1 from 20 allowed ids are all
    among them, streamed or not (a mask: not one token outside, whatever the model prefers); none is ignored."""
    client = server.client()
    allowed = list(range(40, 60))
    kw = dict(model=None, prompt=PROMPTS[1], max_tokens=64, temperature=1.0, seed=5)
    kw["extra_body"] = {"allowed_token_ids": allowed, "ignore_eos": True}
    r = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    streamed = [t for c in chunks for t in getattr(c, "token_ids", None) or []]
    for ids in (getattr(r, "token_ids", None), streamed):
        assert len(ids) == 64 and set(ids) <= set(allowed), ids
    assert streamed == getattr(r, "token_ids", None)  # the same seeded draw
    unmasked = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True}}).choices[0]
    plain = getattr(unmasked, "token_ids", None)
    assert not set(plain) <= set(allowed), "the model draws only those ids anyway: the test could not fail"


def test_vllms_bad_words_through_the_openai_sdk_streamed_and_not(server, run_dir):
    """bad_words in extra_body (vLLM's): a two-token word the model produces never appears among the tokens, and
    the text is what the same decoding gives without it up to where the word would complete; streamed the same.
    The tokens are a seeded sample (the tiny run's greedy text is one token repeated, and its two-token run reads
    back as one token); greedy decoding against the cache-free oracle is tests/engine's masked-greedy test."""
    from resformer_jax.engine.sampling import bad_words_ids
    from resformer_jax.rundir import RunDir

    tok = RunDir(run_dir).tokenizer()
    encode = lambda t: tok.encode(t, add_special_tokens=False).ids
    client = server.client()
    kw = dict(model=None, prompt=PROMPTS[0], max_tokens=24, temperature=1.5, seed=11, extra_body={"ignore_eos": True})
    free = getattr(client.completions.create(**kw).choices[0], "token_ids", None)
    pairs = [
        i
        for i in range(len(free) - 1)
        if tuple(free[i : i + 2]) in bad_words_ids(encode, [tok.decode(free[i : i + 2])])
    ]
    assert pairs, f"no two-token word in the sample reads back as its tokens: {tok.decode(free)!r}"
    i = pairs[0]
    word = tok.decode(free[i : i + 2])
    words = bad_words_ids(encode, [word])
    kw["extra_body"] = {"bad_words": [word], "ignore_eos": True}
    got = getattr(client.completions.create(**kw).choices[0], "token_ids", None)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert [t for c in chunks for t in getattr(c, "token_ids", None) or []] == got
    assert got[: i + 1] == free[: i + 1] and got[i + 1] != free[i + 1], (got, free, i)
    assert not any(tuple(got[j : j + len(w)]) == w for w in words for j in range(len(got))), (got, words)


def test_vllms_stop_token_ids_and_include_stop_str_in_output(server, run_dir):
    """stop_token_ids in extra_body (vLLM's): the choice ends at the first of them, finish_reason 'stop', its text
    the tokens before it (the stop token not shown, as vLLM's detokenizer leaves it out), streamed the same. The
    tokens are a seeded sample (the tiny run's greedy text repeats one token), read off the stream's token_ids."""
    from resformer_jax.rundir import RunDir

    tok = RunDir(run_dir).tokenizer()
    client = server.client()
    kw = dict(model=None, prompt=PROMPTS[0], max_tokens=12, temperature=1.5, seed=11, extra_body={"ignore_eos": True})
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    ids = [t for c in chunks for t in getattr(c, "token_ids", None) or []]
    firsts = [i for i in range(1, len(ids)) if ids[i] not in ids[:i]]
    assert firsts, f"the sample repeats one token: {ids}"
    j = firsts[-1]
    kw["extra_body"] = {"stop_token_ids": [ids[j]], "ignore_eos": True}  # the same seeded tokens, up to the stop
    r = client.completions.create(**kw).choices[0]
    assert r.finish_reason == "stop" and r.text == tok.decode(ids[:j]), (r.text, ids, j)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == r.text
    # include_stop_str_in_output (vLLM's): the stop id shown; and a stop string kept through it, streamed the same
    kw["extra_body"] = {"stop_token_ids": [ids[j]], "ignore_eos": True, "include_stop_str_in_output": True}
    assert client.completions.create(**kw).choices[0].text == tok.decode(ids[: j + 1])
    text = tok.decode(ids)
    at = next(i for i in range(1, len(text) - 1) if text.index(text[i : i + 2]) == i)  # a stop string's first time
    kw["extra_body"] = {"ignore_eos": True}
    for keep, want in ((False, text[:at]), (True, text[: at + 2])):
        kw["extra_body"]["include_stop_str_in_output"] = keep
        got = client.completions.create(stop=[text[at : at + 2]], **kw).choices[0]
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(stream=True, stop=[text[at : at + 2]], **kw)
            if c.choices
        )
        assert got.finish_reason == "stop" and got.text == want == streamed, (keep, got.text, want, streamed, text, ids)


def test_32_concurrent_clients_get_their_single_request_outputs(server):
    client = server.client()
    rng = np.random.default_rng(0)
    prompts = [PROMPTS[i % len(PROMPTS)] * int(rng.integers(1, 6)) for i in range(32)]
    single = {p: greedy(client, p, 10).text for p in set(prompts)}
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: greedy(server.client(), p, 10).text, prompts))
    assert got == [single[p] for p in prompts]
    assert server.metric("vllm:num_requests_running") == 0


@pytest.mark.slow  # 54 programs compiled at start
def test_a_server_that_compiled_at_start_compiles_nothing_under_a_mixed_load(run_dir):
    """#91: with --compile_at_start (the default), streamed and whole requests of every prompt length, greedy and
    sampled, 16 at once through 2 rows, prompts read in chunks of 64: /metrics' resformer:compiles_after_start stays
    0, and the start-up line says how many programs were compiled; a request with logprobs (a variant left out)
    counts as one compile. (2 rows, 2 decode steps, 64-token chunks: 24 programs at start, not 54.)"""
    flags = ("--max_batch=2", "--prefill_rows=2", "--decode_steps=2", "--prefill_chunk=64")
    s = Server(run_dir, "--cache_gib=0.05", *flags, compile_at_start=True)
    try:
        assert s.metric("resformer:compiles_after_start") == 0
        rng = np.random.default_rng(1)
        prompts = ["x" * int(n) for n in rng.integers(1, 200, size=16)]

        def ask(i):
            body = {"prompt": prompts[i], "max_tokens": int(rng.integers(1, 40)), "temperature": float(i % 2),
                    "stream": bool(i % 3 == 0), "ignore_eos": True}  # fmt: skip
            r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(ask, range(16)))
        assert s.metric("resformer:compiles_after_start") == 0
        greedy(s.client(), "def main():", 2, logprobs=2)
        assert s.metric("resformer:compiles_after_start") >= 1
    finally:
        log = s.stop()
    assert re.search(r"compiled and ran once \d+ programs in [0-9.]+ s, holding \d+ MiB", log), log[-2000:]


def test_a_client_that_disconnects_mid_stream_frees_its_pages(server):
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"prompt": "def main():", "max_tokens": 200, "temperature": 0.8, "stream": True},
        timeout=60,
    ) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i >= 6:
                assert server.metric("resformer:kv_cache_pages_used") > 0
                break
    # its pages go back before its end is counted (the engine thread does both, in that order): wait for both
    deadline = time.time() + 10
    while time.time() < deadline and (
        server.metric("resformer:kv_cache_pages_used") > 0
        or 'finished_reason="cancelled"' not in httpx.get(f"{server.url}/metrics").text
    ):
        time.sleep(0.1)
    assert server.metric("resformer:kv_cache_pages_used") == 0
    assert 'finished_reason="cancelled"' in httpx.get(f"{server.url}/metrics").text


@pytest.mark.parametrize(
    "body,status,words",
    [
        (b"{not json", 400, "not valid JSON"),
        ({"prompt": "x" * 1_000_000, "max_tokens": 4}, 400, "exceed the model's context"),
        ({"prompt": "def", "max_tokens": 0}, 400, "max_tokens=0"),
        ({"prompt": "def", "max_tokens": "ten"}, 400, "'max_tokens' Input should be a valid integer"),
        ({"prompt": "def", "temperature": -1}, 400, "'temperature' Input should be greater than or equal to 0"),
        ({"prompt": "def", "stop": [1, 2]}, 400, "'stop"),
        ({"prompt": "def", "logprobs": 21}, 400, "'logprobs' Input should be less than or equal to 20"),
        ({"prompt": "def", "frequency_penalty": 2.5}, 400, "'frequency_penalty' Input should be less than or equal"),
        ({"prompt": "def", "repetition_penalty": 0}, 400, "'repetition_penalty' Input should be greater than 0"),
        ({"prompt": "def", "min_p": 1.5}, 400, "'min_p' Input should be less than or equal to 1"),
        ({"prompt": "def", "logit_bias": {"the": 5}}, 400, "logit_bias key 'the': must be a token id"),
        ({"prompt": "def", "logit_bias": {"99999999": 5}}, 400, "logit_bias names token ids outside the vocabulary"),
        ({"prompt": [[1, 2], "x"]}, 400, "'prompt"),
        ({"prompt": "def", "model": "gpt-4"}, 404, "does not exist"),
        ({"max_tokens": 4}, 400, "'prompt' is required"),
    ],
)
def test_bad_input_is_an_openai_error_and_the_server_goes_on(server, body, status, words):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] in ("invalid_request_error", "not_found_error")
    assert greedy(server.client(), "def main():", 4).text is not None


def test_a_cache_for_4_sequences_queues_16_concurrent_requests(run_dir):
    # 16-token pages; a sequence of up to 10 + 40 tokens takes 4 pages: 17 pages hold 4 sequences
    from resformer_jax.load import load_run
    from resformer_jax.model.transformer import cache_bytes_per_token

    cfg, _, _ = load_run(run_dir)
    gib = 18 * 16 * cache_bytes_per_token(cfg.model) / 2**30
    s = Server(run_dir, f"--cache_gib={gib:.12f}")
    try:
        client = s.client()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(
                pool.map(
                    lambda i: client.completions.create(
                        model=None, prompt="def main():", max_tokens=40, temperature=1.0, seed=i
                    ).choices[0],
                    range(16),
                )
            )
        assert len(got) == 16 and all(c.finish_reason in ("stop", "length") for c in got)
        assert s.metric("resformer:kv_cache_pages_total") == 17
    finally:
        s.stop()


def test_sigterm_lets_8_streams_in_flight_finish_and_exits_0(run_dir):
    s = Server(run_dir, "--cache_gib=0.05")

    def stream(i):
        body = {"prompt": "def main():", "max_tokens": 60, "temperature": 1.0, "seed": i, "stream": True}
        body["stream_options"] = {"include_usage": True}
        events = []
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        return events

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, i) for i in range(8)]
        time.sleep(1.0)
        s.proc.send_signal(signal.SIGTERM)
        results = [f.result(timeout=120) for f in futures]
    log = s.stop()
    assert s.proc.returncode == 0, log
    for events in results:
        assert events[-1] == "[DONE]", events[-3:]
        finals = [json.loads(e) for e in events[:-1] if json.loads(e)["choices"][:1]]
        assert finals[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert "usage" in json.loads(events[-2])


def test_bench_serve_loads_the_server_and_reads_its_cache_gauges(server):
    """`resformer bench serve` with Poisson arrivals: every request served, latency percentiles, and the server's
    own count of the most sequences its cache held (at least 2 at once: requests overlap at 50 a second)."""
    r = run_command(  # in-process: an HTTP client, as the command is
        "bench", "serve", f"--url={server.url}", "--requests=12", "--rate=50", "--prompt_min=4", "--context=24",
        "--new_tokens=6",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    (out,) = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert (out["requests"], out["failed"]) == (12, 0), out
    assert out["tokens_per_s"] > 0 and out["ttft_p50_s"] <= out["ttft_p99_s"] and out["itl_p50_s"] is not None
    # first token to last, a token (0 where a request's tokens came in one chunk; Request's own test checks the sum)
    assert 0 <= out["tpot_p50_s"] <= out["tpot_p99_s"], out
    assert out["server_cache_pages"] == server.metric("resformer:kv_cache_pages_total")
    assert 2 <= out["server_max_sequences_cached"] <= server.metric("resformer:kv_cache_pages_total")


def test_an_exported_folder_serves_the_runs_greedy_text(server, run_dir, tmp_path):
    """`resformer serve --workdir=EXPORT` on what `resformer export` wrote: the same greedy text as the run."""
    hf = str(tmp_path / "hf")
    e = run_command("export", f"--workdir={run_dir}", f"--out={hf}")
    assert e.returncode == 0, e.stderr[-2000:]
    s = Server(hf, "--cache_gib=0.02")
    try:
        for prompt in PROMPTS[:2]:
            assert greedy(s.client(), prompt).text == greedy(server.client(), prompt).text, prompt
        with pytest.raises(openai.BadRequestError, match="--chat_template"):  # a base model: no template, as vLLM
            s.client().chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}])
    finally:
        s.stop()
    # an instruct folder's own template (tokenizer_config.json's chat_template), as vLLM reads it
    config = tmp_path / "hf" / "tokenizer_config.json"
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "chat_template": "Q: {{ messages[0].content }}\nA:"})
    )
    s = Server(hf, "--cache_gib=0.02")
    try:
        chat = s.client().chat.completions.create(
            model=None, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
        )
        assert chat.choices[0].message.content == greedy(s.client(), "Q: hi\nA:", 6).text
    finally:
        s.stop()


def test_the_openai_sdk_unchanged_streams_scores_and_chats(server):
    """#74: the official SDK's everyday calls, sync and async: the plain streaming loop (no usage chunk unless asked),
    stream_options, n, logprobs with top alternatives and offsets, echo (the prompt's log-probabilities, the first
    None; max_tokens 0 scores it alone), a batch of token-id prompts, chat with the template file, streamed and not.
    """
    import asyncio

    client = server.client()
    text = ""
    for chunk in client.completions.create(model=None, prompt="def main():", max_tokens=12, temperature=0, stream=True):
        text += chunk.choices[0].text  # IndexError before: a usage chunk with no choices ended every stream
    assert text == greedy(client, "def main():").text
    chunks = list(
        client.completions.create(
            model=None, prompt="x", max_tokens=3, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 1  # the prompt counted once, not per choice
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.choices for c in chunks[:-1])

    r = client.completions.create(model=None, prompt="def main():", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) >= 3 and value == max(top.values()) and top[token] == value  # greedy: the most likely
    assert lp.text_offset[0] == len("def main():")

    prompt_ids = [[5, 17, 42, 7], [3, 9, 11]]
    echo = client.completions.create(model=None, prompt=prompt_ids, max_tokens=0, echo=True, logprobs=1)
    assert [len(c.logprobs.token_logprobs) for c in echo.choices] == [4, 3] and echo.usage.prompt_tokens == 7
    assert all(c.logprobs.token_logprobs[0] is None for c in echo.choices)
    one = client.completions.create(
        model=None, prompt=prompt_ids[0], max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    np.testing.assert_allclose(one.choices[0].logprobs.token_logprobs[1:4], echo.choices[0].logprobs.token_logprobs[1:])
    many = client.completions.create(model=None, prompt=prompt_ids, max_tokens=5, temperature=0)
    assert [c.text for c in many.choices] == [greedy(client, p, 5).text for p in prompt_ids]

    messages = [{"role": "user", "content": "def main():"}]
    chat = client.chat.completions.create(model=None, messages=messages, max_tokens=6, temperature=0)
    rendered = "user: def main():\nassistant:"
    assert chat.choices[0].message.content == greedy(client, rendered, 6).text
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=None, messages=messages, max_tokens=6, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == chat.choices[0].message.content
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": rendered}).json()["count"] == chat.usage.prompt_tokens

    async def async_stream():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        out = ""
        async for c in await aclient.completions.create(
            model=None, prompt="def main():", max_tokens=12, temperature=0, stream=True
        ):
            out += c.choices[0].text
        return out

    assert asyncio.run(async_stream()) == text


TASK_DIR = os.path.join(ROOT, "configs", "lm_eval_tasks")


def lm_eval_local_completions(server_url: str, model: str, tasks: str, limit: int) -> dict[str, list[dict]]:
    """lm-eval's own `local-completions` API model, unchanged, with its defaults (tokenized requests, 4 concurrent,
    the server's tokenizer found through /tokenizer_info and /tokenize), through `simple_evaluate` in this process:
    lm-eval's CLI indexes its thousands of bundled tasks first (6 s a call). Each task's logged samples."""
    # registers local-completions: a test before may have left lm-eval's registry holding only our model
    import lm_eval.models.openai_completions  # noqa: F401
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(ROOT)  # the shipped task files name ../shared/data/eval_samples relative to the repository
    try:
        res = simple_evaluate(
            model="local-completions",
            model_args=f"model={model},base_url={server_url}/v1/completions,num_concurrent=4",
            tasks=tasks.split(","),
            limit=limit,
            log_samples=True,
            task_manager=TaskManager(include_path=TASK_DIR, include_defaults=False),
        )
    finally:
        os.chdir(cwd)
    return res["samples"]


def _lm_eval_against(server_url, run_dir, tmp_path, tasks="piqa_local,arc_easy_gen_local"):
    """lm-eval's `local-completions` with its defaults (tokenized requests, 4 concurrent, the server's tokenizer
    found by itself through /tokenizer_info and /tokenize) against the server, and `resformer harness` on the same
    run; their per-choice log-likelihoods compared on piqa_local within 1e-4, accuracies equal."""
    pytest.importorskip("tenacity", reason="lm-eval's api extra is not installed (pip install -e '.[lm_eval]')")
    import glob

    task_dir = os.path.join(ROOT, "configs", "lm_eval_tasks")
    common = ["--include_path", task_dir, "--limit", "8", "--log_samples"]
    api = lm_eval_local_completions(server_url, os.path.basename(run_dir), tasks, limit=8)
    own = run_command(  # in this process (HF_*_OFFLINE: tests/conftest.py)
        "harness", "--model", "resformer_jax", "--model_args", f"workdir={run_dir},batch_size=8",
        "--tasks", "piqa_local", "--output_path", str(tmp_path / "own"), *common,
    )  # fmt: skip
    assert own.returncode == 0, own.stderr[-3000:]

    def samples(folder, task):
        if folder == "api":
            return api[task]
        (path,) = glob.glob(str(tmp_path / folder / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        return [json.loads(line) for line in open(path)]

    a, b = samples("api", "piqa_local"), samples("own", "piqa_local")
    assert len(a) == len(b) == 8
    for x, y in zip(a, b):
        np.testing.assert_allclose(
            [float(r[0][0]) for r in x["resps"]], [float(r[0][0]) for r in y["resps"]], atol=1e-4, rtol=0
        )
        assert x["acc"] == y["acc"] and x["acc_norm"] == y["acc_norm"]
    return samples


def test_lm_evals_local_completions_with_its_defaults_equals_the_harness(server, run_dir, shared_data, tmp_path):
    """#74: lm-eval's own API model scores piqa_local and generates arc_easy_gen_local through `resformer serve`;
    every per-choice log-likelihood equals `resformer harness` on the same run within 1e-4."""
    samples = _lm_eval_against(server.url, run_dir, tmp_path)
    assert len(samples("api", "arc_easy_gen_local")) == 8


@pytest.fixture(scope="module")
def neox_run(tmp_path_factory):
    """The paper's 2M ResFormer trained a few steps on ../shared/data's SlimPajama sample prepared by data_prep with
    the GPT-NeoX tokenizer (the issue's run)."""
    from conftest import SHARED_DATA as shared_data

    from resformer_jax.commands.training import run
    from resformer_jax.data.records import load_metadata
    from resformer_jax.data_prep.prepare import prepare
    from resformer_jax.presets import paper_config

    if not shared_data.is_dir():
        pytest.skip(f"{shared_data} is absent: these tests need ../shared/data beside the checkout")
    tmp = tmp_path_factory.mktemp("neox")
    corpus = str(tmp / "sp")
    prepare(
        [str(shared_data / "slimpajama_sample")],
        str(shared_data / "tokenizers" / "gpt-neox-20b.json"),
        corpus,
        seq_len=128,
        quiet=True,
    )
    c = paper_config("2m", "resformer")
    c.data.source, c.data.path, c.data.seq_len, c.model.dtype = "array_record", corpus, 128, "float32"
    c.model.vocab_size = load_metadata(corpus)["tokenizer"]["vocab_size"]
    c.train.steps, c.train.global_batch, c.train.microbatch, c.train.warmup_steps = 10, 4, 0, 2
    c.train.eval_every, c.train.eval_batches, c.mesh.num_devices = 10, 1, 1
    wd = str(tmp / "r2m")
    assert run(c, wd) == 0
    return wd


@pytest.fixture(scope="module")
def neox_server(neox_run):
    """`resformer serve` on the NeoX-prepared 2M run, its prefix cache on (the default, said here)."""
    s = Server(neox_run, "--cache_gib=0.05", "--prefix_cache=true")
    yield s
    s.stop()


def test_lm_eval_through_the_server_on_a_2m_run_trained_on_the_neox_prepared_sample(neox_server, neox_run, tmp_path):
    """#74, as the issue ran it: lm-eval's local-completions through `resformer serve` on the NeoX-prepared 2M run
    equals the harness on piqa_local within 1e-4 (measured 8e-6)."""
    _lm_eval_against(neox_server.url, neox_run, tmp_path, tasks="piqa_local")


def test_hellaswag_through_the_prefix_cache_scores_as_without_it(neox_server, neox_run, tmp_path):
    """#75: lm-eval's hellaswag_local (4 endings a context) through `resformer serve`, the prefix cache on and off:
    every per-choice log-likelihood equal within 1e-5 (measured: bitwise), and the cache's hits counted in
    /metrics. The hit rate is bounded by the data: only the 3 later endings of a context can hit, and only its full
    pages of 16 (not the page holding the context's end): at most 0.39 of the prompt tokens here (measured 0.390 on
    the first 10 contexts)."""
    pytest.importorskip("tenacity", reason="lm-eval's api extra is not installed (pip install -e '.[lm_eval]')")
    got = {}
    for on in ("true", "false"):  # on: the module's server (its counters read before and after); off: its own
        s = neox_server if on == "true" else Server(neox_run, "--cache_gib=0.05", "--prefix_cache=false")
        counters = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
        before = [s.metric(c) for c in counters]
        try:
            samples = lm_eval_local_completions(s.url, "r2m", "hellaswag_local", limit=10)["hellaswag_local"]
            hits, queries = (s.metric(c) - b for c, b in zip(counters, before))
        finally:
            if s is not neox_server:
                s.stop()
        got[on] = (samples, hits, queries)
    (cached, hits, queries), (plain, no_hits, _) = got["true"], got["false"]
    assert len(cached) == len(plain) == 10
    for x, y in zip(cached, plain):
        got, want = ([float(r[0][0]) for r in z["resps"]] for z in (x, y))
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert x["acc"] == y["acc"] and x["acc_norm"] == y["acc_norm"]
    assert no_hits == 0 and hits / queries > 0.3, (hits, queries)


def test_past_the_shutdown_budget_each_stream_ends_with_abort_and_done(run_dir):
    """#73: SIGTERM with long streams in flight and a 2 s budget: each stream still running then gets a final chunk
    with finish_reason "abort" and [DONE]; one log line per request cut, no traceback; exit 0 within the budget
    plus 5 s."""
    # one row at a time: 24 x 250 tokens one step each outlast the budget (an AVX-512 host ran 6 x 250 in under 3 s)
    s = Server(run_dir, "--cache_gib=0.05", "--shutdown_budget_s=2", "--decode_steps=1", "--max_batch=1")
    client = s.client()
    greedy(client, "x", 4)  # compiled: the streams below are decoding when the signal comes

    def stream(i):
        body = {"prompt": "x", "max_tokens": 250, "temperature": 1.0, "seed": i, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        return events

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(stream, i) for i in range(24)]
        time.sleep(1.0)
        s.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        results = [f.result(timeout=60) for f in futures]
    s.proc.wait(30)
    took = time.monotonic() - sent
    log = s.stop()
    assert s.proc.returncode == 0 and took < 2 + 5, (took, log)
    reasons = []
    for events in results:
        assert events[-1] == "[DONE]", events[-3:]
        reasons.append(json.loads(events[-2])["choices"][0]["finish_reason"])
    assert "abort" in reasons and set(reasons) <= {"abort", "length"}, reasons
    assert "Traceback" not in log and "Event loop is closed" not in log, log
    assert log.count("aborted: the 2 s budget ran out") == reasons.count("abort"), log


def test_a_busy_port_and_a_workdir_that_is_a_file_are_refused_before_the_model_loads(run_dir, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "resformer_jax", "serve", f"--workdir={run_dir}", f"--port={port}"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert r.returncode != 0 and "another process holds it" in r.stderr and "serving" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - t < 60
    f = tmp_path / "afile"
    f.write_text("x")
    r = subprocess.run(
        [sys.executable, "-m", "resformer_jax", "serve", f"--workdir={f}"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode != 0 and "is a file, not a directory" in r.stderr, r.stderr


def test_bench_serve_check_reports_each_part_of_the_api_the_server_answers(server):
    """#74: `resformer bench serve --check` against the server (with its chat template): every check passes, one line
    each."""
    r = run_command("bench", "serve", f"--url={server.url}", "--check")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith(("ok", "FAIL"))]
    assert len(lines) == 14 and all(x.startswith("ok") for x in lines), r.stdout
    assert "a message, and a stream that starts with the role" in r.stdout and "greedy repeats it" in r.stdout
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["failed"] == [] and summary["passed"] == 14


def test_bench_serve_check_names_what_a_server_lacks_and_exits_1():
    """A stub that answers /v1/models and nothing else: every other check FAILs by name, exit 1."""
    import http.server
    import threading

    class Stub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "stub", "max_model_len": 64}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{stub.server_address[1]}"
        r = run_command("bench", "serve", f"--url={url}", "--check")
    finally:
        stub.shutdown()
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    assert "ok    GET /v1/models" in r.stdout and "FAIL  completions: echo with logprobs" in r.stdout, r.stdout
    assert json.loads(r.stdout.strip().splitlines()[-1])["passed"] == 1


def test_a_streams_logprobs_and_text_offsets_are_the_whole_responses(server):
    """Streamed, each token's logprobs record (its text, value, alternatives and text offset, the prompt's first
    where echoed) is the one the non-streamed response gives at that position, with echo and without."""
    client = server.client()
    for echo in (False, True):
        kw = dict(model=None, prompt="def main():", max_tokens=6, temperature=0, logprobs=2, echo=echo)
        whole = client.completions.create(**kw).choices[0].logprobs
        tokens, values, offsets, tops = [], [], [], []
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    values += c.logprobs.token_logprobs
                    offsets += c.logprobs.text_offset
                    tops += c.logprobs.top_logprobs
        assert (tokens, offsets) == (whole.tokens, whole.text_offset) and len(tokens) >= 6 + echo
        rounded = lambda vs: [None if v is None else round(v, 4) for v in vs]
        assert rounded(values) == rounded(whole.token_logprobs)
        assert [sorted(t or {}) for t in tops] == [sorted(t or {}) for t in whole.top_logprobs]
