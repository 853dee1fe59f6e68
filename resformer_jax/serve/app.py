"""The OpenAI-compatible app, in FastAPI's idiom (module-level routes, pydantic request models: serve/protocol.py):
POST /v1/completions and /v1/chat/completions (streamed as server-sent events or not), GET /v1/models, vLLM's POST
/tokenize and /detokenize and GET /tokenizer_info, GET /health, GET /metrics. Bad input is an OpenAI-style JSON
error (400; 404 for another model), one line in the log, and the server goes on. What the routes share lives in
`Serving`, on `app.state.serving`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import threading
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from resformer_jax.engine import EngineError, SamplingParams
from resformer_jax.engine.detokenizer import IncrementalText
from resformer_jax.engine.engine import Finished, FinishReason, NewToken, Output, Scores
from resformer_jax.engine.sampling import bad_words_ids
from resformer_jax.serve.engine_thread import EngineThread, Handle
from resformer_jax.serve.metrics import ServeMetrics
from resformer_jax.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIModel,
    SamplingFields,
    TokenizeRequest,
)
from resformer_jax.serve.protocol import FinishReason as OpenAIFinishReason

log = logging.getLogger("resformer_jax.serve")
router = APIRouter()


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status == 400 else "not_found_error"
    log.warning("request refused (%d): %s", status, message)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


@dataclasses.dataclass
class Serving:
    """What every route reads: the engine's thread, the tokenizer (None: token ids only), the names and limits,
    the chat template, and the requests in flight (ended with `abort` at shutdown)."""

    engine_thread: EngineThread
    tokenizer: Any
    model_name: str
    metrics: ServeMetrics
    chat_template: str | None = None
    trained_len: int | None = None  # the sequence length the run trained at (None: unknown, an export)
    live: dict = dataclasses.field(default_factory=dict)  # {Handle: "its request id#choice"}, not yet finished
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def eot(self) -> int | None:
        return self.tokenizer.token_to_id("<|endoftext|>") if self.tokenizer is not None else None

    @property
    def max_len(self) -> int:
        return self.engine_thread.engine.max_len

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def token_text(self, t: int) -> str:
        return self.decode([t]) if self.tokenizer is not None else str(t)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest(
                "this run trained on token ids only (no tokenizer): send 'prompt' as a list of token ids", "prompt"
            )
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def abort_all(self, why: str) -> int:
        """Ends every request in flight with finish_reason `abort` (shutdown's budget spent): one line each."""
        with self.lock:
            live = list(self.live.items())
        for h, name in live:
            self.engine_thread.cancel(h, "abort", say=f"request {name} aborted: {why}")
        return len(live)


def make_app(
    engine_thread: EngineThread,
    tokenizer,
    model_name: str,
    metrics: ServeMetrics,
    chat_template: str | None = None,
    trained_len: int | None = None,
) -> FastAPI:
    """The app over a started engine thread; `tokenizer` None: a run trained on token ids serves ids only."""
    app = FastAPI(title="resformer_jax", docs_url=None, redoc_url=None)
    app.state.serving = Serving(engine_thread, tokenizer, model_name, metrics, chat_template, trained_len)
    app.include_router(router)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(BadRequest, bad_request)
    return app


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """pydantic's complaint as one OpenAI-style line naming the field."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    first = errors[0] if errors else {"loc": (), "msg": str(exc), "type": ""}
    if first.get("type") == "json_invalid" or (
        tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), (bytes, str))
    ):
        return error_response(f"the body is not valid JSON ({first.get('msg')})")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    field = loc[0] if loc else None
    if first.get("type") == "missing" and field:
        return error_response(f"'{field}' is required", param=field)
    where = ".".join(loc) or "the body"
    return error_response(f"'{where}' {first.get('msg', 'is invalid')} (got {first.get('input')!r})", param=field)


async def bad_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BadRequest)
    return error_response(str(exc), exc.status, exc.param)


def serving_of(request: Request) -> Serving:
    return request.app.state.serving


def check_model(s: Serving, req: OpenAIModel) -> None:
    name = getattr(req, "model", None)
    if name is not None and name != s.model_name:
        raise BadRequest(f"The model '{name}' does not exist; this server serves '{s.model_name}'", "model", 404)
    if ignored := req.ignored_fields():
        log.warning("The following fields were present in the request but ignored: %s", ", ".join(ignored))


def sampling_params(
    s: Serving, req: SamplingFields, max_tokens: int, seed: int, j: int, logprobs: Logprobs
) -> SamplingParams:
    top_k = req.top_k if req.top_k and req.top_k > 0 else 0
    stop_ids = ((s.eot,) if s.eot is not None and not req.ignore_eos else ()) + tuple(req.stop_token_ids or ())
    try:
        logit_bias = req.logit_bias_pairs()
    except ValueError as e:
        raise BadRequest(str(e), "logit_bias") from None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(1.0 if req.temperature is None else req.temperature),
        top_k=top_k,
        top_p=float(1.0 if req.top_p is None else req.top_p),
        seed=seed + j,
        stop_ids=stop_ids,
        min_tokens=req.min_tokens,
        logprobs=logprobs.generated,
        prompt_logprobs=logprobs.prompt,
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=float(1.0 if req.repetition_penalty is None else req.repetition_penalty),
        min_p=float(req.min_p or 0.0),
        logit_bias=logit_bias,
        allowed_token_ids=tuple(req.allowed_token_ids or ()),
        bad_words_ids=bad_words_ids(s.encode, req.bad_words or ()),
    )


def prompts_of(s: Serving, prompt) -> list[list[int]]:
    """A prompt as OpenAI takes it: text, a list of texts, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [s.encode(prompt)]
    if not prompt:
        raise BadRequest("'prompt' is empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [s.encode(p) for p in prompt]
    return [list(p) for p in prompt]


def cut(text: str, stops: list[str], keep: bool = False) -> str:
    """The text before its first stop string (keep: through it, vLLM's include_stop_str_in_output)."""
    found = [(text.index(stop), stop) for stop in stops if stop in text]
    if not found:
        return text
    at, stop = min(found)
    return text[: at + len(stop) * keep]


# ---------------------------------------------------------------------------------------------- running a request


@dataclasses.dataclass
class Choice:
    """One choice in flight: its prompt, its engine handle, the queue its tokens arrive on."""

    index: int
    prompt: list[int]
    queue: asyncio.Queue
    handle: Handle | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None  # the engine's
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)  # as submitted (stop ids, min_tokens)
    keep_stop: bool = False  # include_stop_str_in_output: the stop string or id that ended it shown
    shown: list[int] = dataclasses.field(default_factory=list)  # streamed: the tokens sent (no stop id)
    shown_text: IncrementalText | None = None  # streamed: their text, decoded as they come
    text: str = ""  # streamed: the text sent so far, cut at a stop string
    offset: int = 0  # streamed: where the latest shown token's text begins in shown_text

    def ended_by(self, token: int) -> bool:
        """Whether `token`, its latest, is a stop id that ends it (the engine's rule: from min_tokens on)."""
        return token in self.params.stop_ids and len(self.tokens) >= self.params.min_tokens


def stream_delta(s: Serving, c: Choice, token: int, stops: list[str]) -> str | None:
    """A streamed token's new text (None: the stop id that ends the choice, not shown; its reason follows). Until
    a stop string comes, the last len(longest stop) - 1 characters are held back (a stop string may begin there,
    as vLLM's detokenizer holds them); `stream_rest` sends them at the end."""
    c.tokens.append(token)
    if c.ended_by(token) and not c.keep_stop:
        return None
    c.shown.append(token)
    c.shown_text = c.shown_text or IncrementalText(s.decode)
    c.offset = len(c.shown_text.text)
    c.shown_text.add(token)
    decoded = c.shown_text.text
    full = cut(decoded, stops, c.keep_stop)
    if stops and full == decoded:  # no stop string yet
        full = full[: max(len(c.text), len(full) - max(len(x) for x in stops) + 1)]
    delta, c.text = full[len(c.text) :], full
    return delta


def stream_rest(s: Serving, c: Choice, stops: list[str]) -> str:
    """The text stream_delta held back, sent with the finish reason."""
    full = cut(s.decode(c.shown), stops, c.keep_stop)
    rest, c.text = full[len(c.text) :], full
    return rest


def submit(s: Serving, choice: Choice, stops: list[str], rid: str) -> None:
    loop = asyncio.get_running_loop()
    min_tokens = choice.params.min_tokens
    seen = IncrementalText(s.decode, stops)  # read on the engine thread only

    def on_output(r, out: Output):
        with contextlib.suppress(RuntimeError):  # the event loop has closed (the server is gone): nobody waits
            loop.call_soon_threadsafe(choice.queue.put_nowait, out)
        # after the token is queued: the one that completes a stop string is read before the end that follows it
        if isinstance(out, NewToken) and seen.stops:
            seen.add(out.token)
            if len(r.tokens) >= min_tokens and seen.stop_found():
                s.engine_thread.engine.cancel(r, "stop")  # the engine thread: end it at once

    choice.handle = s.engine_thread.submit(choice.prompt, choice.params, on_output)
    with s.lock:
        s.live[choice.handle] = f"{rid}#{choice.index}"


def finished(s: Serving, choices: list[Choice]) -> None:
    """The choices are over (done, or their client gone): cancel what still runs, forget them."""
    for c in choices:
        if c.handle is None:
            continue
        if c.handle.request is None or not c.handle.request.done:
            s.engine_thread.cancel(c.handle)
        with s.lock:
            s.live.pop(c.handle, None)


@dataclasses.dataclass(frozen=True)
class Logprobs:
    """What a request asks the engine to score: the N most likely tokens at each generated position, and at each
    prompt position (echo); None: not asked."""

    generated: int | None = None
    prompt: int | None = None


def start(
    s: Serving,
    req: SamplingFields,
    prompts: list[list[int]],
    max_tokens: int | None,
    rid: str,
    logprobs: Logprobs = Logprobs(),
) -> list[Choice]:
    """Every prompt's n choices checked, then submitted: index prompt * n + j (vLLM's order)."""
    seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
    plans = []
    for ids in prompts:
        if not ids or not all(isinstance(t, int) for t in ids):
            raise BadRequest("'prompt' must be text, a list of texts, token ids or a list of token-id lists", "prompt")
        new = max_tokens if max_tokens is not None else max(s.max_len - len(ids), 1)
        for j in range(req.n):
            params = sampling_params(s, req, new, seed, j, logprobs)
            try:
                s.engine_thread.engine.check(ids, params)
            except EngineError as e:
                raise BadRequest(str(e)) from None
            plans.append((ids, params))
    keep = req.include_stop_str_in_output
    choices = [Choice(i, ids, asyncio.Queue(), params=p, keep_stop=keep) for i, (ids, p) in enumerate(plans)]
    for c in choices:
        submit(s, c, req.stops, rid)
    return choices


def kept_tokens(c: Choice) -> list[int]:
    """The tokens a client sees: the stop id (end-of-text, stop_token_ids) that ended a choice is not shown."""
    if c.finish_reason == "stop" and c.tokens and c.tokens[-1] in c.params.stop_ids and not c.keep_stop:
        return c.tokens[:-1]
    return c.tokens


async def collect(c: Choice) -> None:
    while True:
        out = await c.queue.get()
        if isinstance(out, Finished):
            c.finish_reason = out.reason
            return
        c.tokens.append(out.token)


def reason_of(engine_reason: FinishReason | None) -> OpenAIFinishReason:
    """OpenAI's reason for the engine's: a stop id or string "stop", the server's or the engine's end "abort", the
    rest (max_tokens, the context, a cancel) "length"."""
    openai: dict[str | None, OpenAIFinishReason] = {"stop": "stop", "abort": "abort", "error": "abort"}
    return openai.get(engine_reason, "length")


async def until_done_or_gone(request: Request, s: Serving, choices: list[Choice]) -> None:
    """Waits for every choice; a client that went away frees its pages at once."""

    async def cancel_when_gone():
        while not await request.is_disconnected():
            await asyncio.sleep(0.1)
        finished(s, choices)

    watcher = asyncio.create_task(cancel_when_gone())
    try:
        await asyncio.gather(*(collect(c) for c in choices))
    finally:
        watcher.cancel()
        finished(s, choices)


def scores_of(c: Choice) -> Scores:
    r = c.handle.request if c.handle is not None else None
    if r is None or r.scores is None:
        raise RuntimeError("a choice asked for log-probabilities has none")  # start() asks the engine for them
    return r.scores


def logprobs_record(s: Serving, scored: Scores, ids: list[int], start: int, n: int, offset0: int) -> dict:
    """OpenAI's completion logprobs for ids[start:] (the prompt and the tokens kept, as the engine scored them):
    each token's text, its log-probability (None for a sequence's first token), the n most likely tokens there,
    and its text offset."""
    tokens, offsets, text = [], [], ""
    for t in ids[start:]:
        offsets.append(offset0 + len(text))
        piece = s.token_text(t)
        tokens.append(piece)
        text += piece
    top: list[dict | None] = []
    for i in range(start, len(ids)):
        alts = scored.top[i]
        if alts is None:
            top.append(None)
            continue
        entry = {s.token_text(int(a)): float(lp) for a, lp in zip(alts[0][:n], alts[1][:n])}
        entry.setdefault(s.token_text(ids[i]), float(scored.logprob[i] or 0.0))  # the chosen token is always there
        top.append(entry)
    return {
        "tokens": tokens,
        "token_logprobs": scored.logprob[start : len(ids)],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def envelope(s: Serving, rid: str, created: int, kind: str, choices: list, **extra) -> dict:
    """OpenAI's frame around choices, for a response and for each streamed chunk alike."""
    return {"id": rid, "object": kind, "created": created, "model": s.model_name, "choices": choices, **extra}


def usage(prompts: list[list[int]], choices: list[Choice]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)  # each prompt once, however many choices it has
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


# ---------------------------------------------------------------------------------------------- routes


@router.get("/health")
async def health():
    return PlainTextResponse("ok")


@router.get("/v1/models")
async def models(request: Request):
    s = serving_of(request)
    m = s.engine_thread.engine.model_cfg  # max_model_len as vLLM gives it; vocab_size for clients sending ids
    entry = {"id": s.model_name, "object": "model", "owned_by": "resformer_jax", "max_model_len": s.max_len}
    if s.trained_len is not None:  # prompts past it are extrapolation
        entry["trained_seq_len"] = s.trained_len
    return {"object": "list", "data": [{**entry, "vocab_size": m.vocab_size}]}


@router.get("/metrics")
async def prometheus(request: Request):
    return PlainTextResponse(generate_latest(serving_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    s = serving_of(request)
    if s.tokenizer is None:
        raise BadRequest("this run trained on token ids only: it has no tokenizer", status=404)
    eos = "<|endoftext|>" if s.eot is not None else None
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": None,
        "pad_token": eos,
        "chat_template": s.chat_template,
        "model_max_length": s.max_len,
    }


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    s = serving_of(request)
    check_model(s, req)
    if req.messages is not None:
        text = render_chat(s, req.messages, req.add_generation_prompt, None)
    elif req.prompt is not None:
        text = req.prompt
    else:
        raise BadRequest("give 'prompt' (text) or 'messages'", "prompt")
    ids = s.encode(text)
    return {"count": len(ids), "max_model_len": s.max_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    s = serving_of(request)
    check_model(s, req)
    vocab = s.engine_thread.engine.model_cfg.vocab_size
    if any(t < 0 or t >= vocab for t in req.tokens):
        raise BadRequest(f"'tokens' holds ids outside the vocabulary [0, {vocab})", "tokens")
    if s.tokenizer is None:
        raise BadRequest("this run trained on token ids only: it has no tokenizer", status=404)
    return {"prompt": s.decode(req.tokens)}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    s = serving_of(request)
    check_model(s, req)
    prompts = prompts_of(s, req.prompt)
    if req.max_tokens == 0 and not req.echo:
        raise BadRequest("max_tokens=0: must be a positive integer (0 only with echo: the prompt scored)", "max_tokens")
    rid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
    if req.max_tokens == 0 and req.logprobs is None:  # echo alone: nothing to compute
        choices = [Choice(i * req.n + j, ids, asyncio.Queue()) for i, ids in enumerate(prompts) for j in range(req.n)]
        for c in choices:
            c.finish_reason = "length"
        if req.stream:
            return event_stream(stream_completion(s, request, req, rid, created, prompts, choices, run=False))
        return await completion_response(s, req, rid, created, prompts, choices)
    asked = Logprobs(req.logprobs, req.logprobs if req.echo else None)  # echo: the prompt's too, read in its prefill
    choices = start(s, req, prompts, req.max_tokens, rid, asked)
    if req.stream:
        return event_stream(stream_completion(s, request, req, rid, created, prompts, choices))
    await until_done_or_gone(request, s, choices)
    return await completion_response(s, req, rid, created, prompts, choices)


async def completion_response(s, req: CompletionRequest, rid, created, prompts, choices: list[Choice]) -> dict:
    out = []
    for c in choices:
        kept = kept_tokens(c)
        text = cut(s.decode(kept), req.stops, c.keep_stop)
        prompt_text = s.decode(c.prompt)
        entry: dict[str, Any] = {
            "index": c.index,
            "text": (prompt_text + text) if req.echo else text,
            "token_ids": kept,
            "logprobs": None,
            "finish_reason": reason_of(c.finish_reason),
        }
        if req.logprobs is not None:
            ids = c.prompt + kept
            start_at = 0 if req.echo else len(c.prompt)
            offset0 = 0 if req.echo else len(prompt_text)
            entry["logprobs"] = logprobs_record(s, scores_of(c), ids, start_at, req.logprobs, offset0)
        out.append(entry)
    return envelope(s, rid, created, "text_completion", out, usage=usage(prompts, choices))


async def merged_outputs(choices: list[Choice]):
    """(choice, its engine output: NewToken or Finished) as they come, over every choice, until each has ended."""
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(c: Choice):
        while True:
            out = await c.queue.get()
            await merged.put((c, out))
            if isinstance(out, Finished):
                return

    tasks = [asyncio.create_task(forward(c)) for c in choices]
    try:
        left = len(choices)
        while left:
            c, out = await merged.get()
            if isinstance(out, Finished):
                left -= 1
                c.finish_reason = out.reason
            yield c, out
    finally:
        for t in tasks:
            t.cancel()


def event_stream(events) -> StreamingResponse:
    """Server-sent events, as OpenAI streams them."""
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def stream_completion(
    s: Serving, request: Request, req: CompletionRequest, rid, created, prompts, choices, run: bool = True
):
    """One event a token a choice (its text delta), each choice's finish reason, the usage chunk where
    `stream_options.include_usage` asks, then [DONE]. A client that goes away cancels its requests."""

    def chunk(choice_list, **extra):
        return envelope(s, rid, created, "text_completion", choice_list, **extra)

    echoed: set[int] = set()
    prompt_chars = {c.index: len(s.decode(c.prompt)) for c in choices} if req.logprobs is not None else {}

    def echo(c: Choice) -> str:  # a choice's prompt first; with logprobs, once its prefill has scored it
        echoed.add(c.index)
        entry = {"index": c.index, "text": s.decode(c.prompt), "logprobs": None, "finish_reason": None}
        if req.logprobs is not None:
            entry["logprobs"] = logprobs_record(s, scores_of(c), c.prompt, 0, req.logprobs, 0)
        return sse(chunk([entry]))

    try:
        if req.echo and (req.logprobs is None or not run):
            for c in choices:
                yield echo(c)
        if run:
            async for c, out in merged_outputs(choices):
                if req.echo and c.index not in echoed:
                    yield echo(c)
                entry = {"index": c.index, "text": "", "logprobs": None, "finish_reason": None}
                if isinstance(out, NewToken):
                    if (delta := stream_delta(s, c, out.token, req.stops)) is None:
                        continue  # the finish reason follows
                    entry["text"], entry["token_ids"] = delta, [out.token]
                    if req.logprobs is not None:  # this token's, over the prompt and what came before it
                        ids, offset = c.prompt + c.shown, prompt_chars[c.index] + c.offset
                        entry["logprobs"] = logprobs_record(s, scores_of(c), ids, len(ids) - 1, req.logprobs, offset)
                else:
                    entry["text"], entry["finish_reason"] = stream_rest(s, c, req.stops), reason_of(out.reason)
                yield sse(chunk([entry]))
        else:
            for c in choices:
                yield sse(chunk([{"index": c.index, "text": "", "logprobs": None, "finish_reason": "length"}]))
        if req.include_usage:
            yield sse(chunk([], usage=usage(prompts, choices)))
        yield "data: [DONE]\n\n"
    finally:
        finished(s, choices)


# ---------------------------------------------------------------------------------------------- chat


def render_chat(s: Serving, messages, add_generation_prompt: bool, template: str | None) -> str:
    """The messages as the chat template renders them (Jinja, as transformers and vLLM render it)."""
    source = template or s.chat_template
    if not source:
        raise BadRequest(
            "this model has no chat template (a base model); start the server with --chat_template=FILE (a Jinja "
            "template, as vLLM takes it), or send 'chat_template' with the request",
            "messages",
        )
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source).render(
            messages=[{"role": m.role, "content": m.text()} for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token="",
            eos_token="<|endoftext|>" if s.eot is not None else "",
        )
    except jinja2.exceptions.TemplateError as e:
        raise BadRequest(f"the chat template failed: {e}", "messages") from None


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    s = serving_of(request)
    check_model(s, req)
    prompt = s.encode(render_chat(s, req.messages, req.add_generation_prompt, req.chat_template))
    max_tokens = req.max_completion_tokens or req.max_tokens
    rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
    n_top = (req.top_logprobs or 0) if req.logprobs else None
    choices = start(s, req, [prompt], max_tokens, rid, Logprobs(n_top))
    if req.stream:
        return event_stream(stream_chat(s, req, rid, created, prompt, choices, n_top))
    await until_done_or_gone(request, s, choices)
    out = []
    for c in choices:
        kept = kept_tokens(c)
        entry: dict[str, Any] = {
            "index": c.index,
            "message": {"role": "assistant", "content": cut(s.decode(kept), req.stops, c.keep_stop)},
            "logprobs": None,
            "finish_reason": reason_of(c.finish_reason),
        }
        if n_top is not None and kept:
            entry["logprobs"] = chat_logprobs(s, scores_of(c), prompt + kept, len(prompt), n_top)
        out.append(entry)
    return envelope(s, rid, created, "chat.completion", out, usage=usage([prompt], choices))


def chat_logprobs(s: Serving, scored: Scores, ids: list[int], start: int, n: int) -> dict:
    """Chat's logprobs shape: a content list, one entry a token, its top_logprobs a list."""
    content = []
    for i in range(start, len(ids)):
        alts, lps = scored.top[i] or ([], [])
        content.append(
            {
                "token": s.token_text(ids[i]),
                "logprob": scored.logprob[i],
                "bytes": list(s.token_text(ids[i]).encode()),
                "top_logprobs": [
                    {"token": s.token_text(int(a)), "logprob": float(lp), "bytes": list(s.token_text(int(a)).encode())}
                    for a, lp in zip(alts[:n], lps[:n])
                ],
            }
        )
    return {"content": content}


async def stream_chat(s: Serving, req: ChatCompletionRequest, rid, created, prompt, choices, n_top):
    def chunk(choice_list, **extra):
        return envelope(s, rid, created, "chat.completion.chunk", choice_list, **extra)

    try:
        for c in choices:  # the role first, as OpenAI streams it
            role = {"role": "assistant", "content": ""}
            yield sse(chunk([{"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}]))
        async for c, out in merged_outputs(choices):
            entry: dict[str, Any] = {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": None}
            if isinstance(out, NewToken):
                if (delta := stream_delta(s, c, out.token, req.stops)) is None:
                    continue
                entry["delta"] = {"content": delta}
                if n_top is not None:
                    ids = prompt + c.shown
                    entry["logprobs"] = chat_logprobs(s, scores_of(c), ids, len(ids) - 1, n_top)
            else:
                entry["delta"] = {"content": rest} if (rest := stream_rest(s, c, req.stops)) else {}
                entry["finish_reason"] = reason_of(out.reason)
            yield sse(chunk([entry]))
        if req.include_usage:
            yield sse(chunk([], usage=usage([prompt], choices)))
        yield "data: [DONE]\n\n"
    finally:
        finished(s, choices)
