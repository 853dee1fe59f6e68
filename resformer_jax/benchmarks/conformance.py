"""`resformer bench serve --check --url=URL`: which parts of the OpenAI API (as OpenAI and vLLM implement it) a
running server answers as the spec says, each a named check with what it saw. Written against the wire format with
httpx, so it can be pointed at any server: this project's, vLLM's, another's."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


class Conformance:
    def __init__(self, url: str, timeout: float = 300.0):
        import httpx

        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout)
        models = self.http.get(f"{self.url}/v1/models").json()["data"]
        self.model = models[0]["id"]
        self.entry = models[0]

    def post(self, path: str, body: dict):
        return self.http.post(f"{self.url}{path}", json={"model": self.model, **body})

    def complete(self, **body) -> dict:
        r = self.post("/v1/completions", body)
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code}: {r.text[:200]}")
        return r.json()

    def stream(self, path: str, body: dict) -> list:
        """The server-sent events of a streamed request: each a parsed chunk, '[DONE]' as itself."""
        events = []
        with self.http.stream("POST", f"{self.url}{path}", json={"model": self.model, **body, "stream": True}) as r:
            if r.status_code != 200:
                raise AssertionError(f"HTTP {r.status_code}: {r.read().decode()[:200]}")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        return events

    # ------------------------------------------------------------------------------------------ the checks
    def models(self) -> str:
        assert isinstance(self.entry.get("max_model_len"), int), f"no max_model_len in {self.entry}"
        return f"{self.model}, max_model_len {self.entry['max_model_len']}"

    def text_prompt(self) -> str:
        out = self.complete(prompt="Hello", max_tokens=4, temperature=0)
        c = out["choices"][0]
        assert isinstance(c["text"], str) and c["finish_reason"] in ("stop", "length"), c
        assert out["usage"]["completion_tokens"] >= 1, out["usage"]
        return f"{out['usage']['completion_tokens']} tokens, finish_reason {c['finish_reason']}"

    def prompt_forms(self) -> str:
        ids = self.tokenize("Hello world")
        for prompt, n in ((["Hello", "world"], 2), (ids, 1), ([ids, ids[:1]], 2)):
            out = self.complete(prompt=prompt, max_tokens=2, temperature=0)
            assert sorted(c["index"] for c in out["choices"]) == list(range(n)), (prompt, out["choices"])
        return "a list of texts, token ids and a list of token-id lists each answered, one choice a prompt"

    def plain_stream(self) -> str:
        events = self.stream("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert events and events[-1] == "[DONE]", events[-2:]
        empty = [e for e in events[:-1] if not e["choices"]]
        assert not empty, f"{len(empty)} chunk(s) with no choices without stream_options (breaks chunk.choices[0])"
        return f"{len(events) - 1} chunks, each with a choice, then [DONE]"

    def usage_chunk(self) -> str:
        body = {"prompt": "Hello", "max_tokens": 3, "stream_options": {"include_usage": True}}
        events = self.stream("/v1/completions", body)
        last = events[-2]
        assert last["choices"] == [] and last.get("usage"), last
        return f"the last chunk: choices [], usage {last['usage']}"

    def echo_logprobs(self) -> str:
        ids = self.tokenize("The cat sat on the mat")
        out = self.complete(prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
        lp = out["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None, lp["token_logprobs"]
        assert all(isinstance(t, dict) and t for t in lp["top_logprobs"][1:]), lp["top_logprobs"][:3]
        scored = self.complete(prompt=ids, max_tokens=0, echo=True, logprobs=1)["choices"][0]["logprobs"]
        assert len(scored["token_logprobs"]) == len(ids), scored
        return f"{len(ids)} prompt tokens scored (the first null); max_tokens 0 scores the prompt alone"

    def top_logprobs(self) -> str:
        lp = self.complete(prompt="Hello", max_tokens=3, logprobs=2, temperature=0)["choices"][0]["logprobs"]
        assert all(len(t) >= 2 for t in lp["top_logprobs"]), lp["top_logprobs"]
        assert len(lp["text_offset"]) == len(lp["tokens"]), lp
        return "2 alternatives a position, text_offset per token"

    def n_choices(self) -> str:
        one = self.complete(prompt="Hello", max_tokens=2)
        two = self.complete(prompt="Hello", max_tokens=2, n=2)
        assert len(two["choices"]) == 2, two["choices"]
        assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"], (one["usage"], two["usage"])
        return "2 choices; the prompt counted once in usage"

    def fixed_lengths(self) -> str:
        out = self.complete(prompt="Hello", max_tokens=8, min_tokens=8, ignore_eos=True)
        assert out["usage"]["completion_tokens"] == 8, out["usage"]
        return "min_tokens = max_tokens with ignore_eos: exactly 8 tokens"

    def logit_bias(self) -> str:
        token = self.tokenize("Hello")[0]
        out = self.complete(prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(token): 100})
        want = self.post("/detokenize", {"tokens": [token] * 4}).json()["prompt"]
        assert out["choices"][0]["text"] == want, (out["choices"][0]["text"], want)
        return f"a bias of 100 on token {token}: greedy repeats it"

    def tokenize(self, text: str = "Hello world") -> list[int]:
        r = self.post("/tokenize", {"prompt": text})
        assert r.status_code == 200, f"/tokenize: HTTP {r.status_code}"
        return r.json()["tokens"]

    def tokenizer_round_trip(self) -> str:
        ids = self.tokenize("Hello world")
        text = self.post("/detokenize", {"tokens": ids}).json()["prompt"]
        assert text == "Hello world", text
        return f"/tokenize and /detokenize round-trip ({len(ids)} tokens)"

    def chat(self) -> str:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = self.post("/v1/chat/completions", body)
        if r.status_code == 400 and "chat template" in r.text:
            return "no chat template (a base model): 400 naming it, as vLLM answers"
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}"
        msg = r.json()["choices"][0]["message"]
        assert msg["role"] == "assistant" and isinstance(msg["content"], str), msg
        events = self.stream("/v1/chat/completions", body)
        assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"].get("role") == "assistant", events[:2]
        return "a message, and a stream that starts with the role"

    def unknown_field(self) -> str:
        r = self.post("/v1/completions", {"prompt": "Hello", "max_tokens": 1, "frobnicate": 1})
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}"
        return "accepted (vLLM warns and ignores it)"

    def bad_request(self) -> str:
        r = self.post("/v1/completions", {"prompt": "Hello", "max_tokens": "ten"})
        assert r.status_code == 400 and "message" in r.json().get("error", {}), (r.status_code, r.text[:200])
        return f"400: {r.json()['error']['message'][:80]}"

    def run(self) -> list[Check]:
        checks: list[tuple[str, Callable[[], str]]] = [
            ("GET /v1/models with max_model_len", self.models),
            ("completions: a text prompt", self.text_prompt),
            ("completions: texts, token ids, lists of token ids", self.prompt_forms),
            ("completions: a plain stream (no usage chunk unasked)", self.plain_stream),
            ("completions: stream_options.include_usage", self.usage_chunk),
            ("completions: echo with logprobs", self.echo_logprobs),
            ("completions: logprobs N with text_offset", self.top_logprobs),
            ("completions: n", self.n_choices),
            ("completions: min_tokens and ignore_eos", self.fixed_lengths),
            ("completions: logit_bias", self.logit_bias),
            ("POST /tokenize and /detokenize", self.tokenizer_round_trip),
            ("chat completions", self.chat),
            ("an unknown field", self.unknown_field),
            ("bad input: 400 in OpenAI's error shape", self.bad_request),
        ]
        out = []
        for name, check in checks:
            try:
                out.append(Check(name, True, check()))
            except Exception as e:  # a check that fails says what it saw; the next one runs
                out.append(Check(name, False, f"{type(e).__name__}: {str(e)[:300]}"))
        return out


def check_server(url: str) -> list[Check]:
    return Conformance(url).run()
