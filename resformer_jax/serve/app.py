"""The OpenAI-compatible app: POST /v1/completions (text or token ids; streamed as server-sent events or not),
GET /v1/models, GET /health, GET /metrics. Bad input is an OpenAI-style JSON error (400; 404 for another model),
one line in the log, and the server goes on."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from resformer_jax.engine import EngineError, SamplingParams
from resformer_jax.serve.engine_thread import EngineThread
from resformer_jax.serve.metrics import ServeMetrics

log = logging.getLogger("resformer_jax.serve")

# (field, accepted types, default): what /v1/completions reads; other fields are ignored, as vLLM does
FIELDS: Mapping[str, tuple[tuple[type, ...], Any]] = MappingProxyType(
    {
        "model": ((str,), None),
        "prompt": ((str, list), None),
        "max_tokens": ((int,), 16),
        "temperature": ((int, float), 1.0),
        "top_p": ((int, float), 1.0),
        "top_k": ((int,), 0),
        "seed": ((int,), None),
        "stop": ((str, list), None),
        "n": ((int,), 1),
        "stream": ((bool,), False),
        "logprobs": ((int,), None),
        "echo": ((bool,), False),
    }
)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status == 400 else "not_found_error"
    log.warning("request refused (%d): %s", status, message)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def make_app(engine_thread: EngineThread, tokenizer, model_name: str, metrics: ServeMetrics) -> FastAPI:
    """The app over a started engine thread; `tokenizer` None: a run trained on token ids serves ids only."""
    app = FastAPI(title="resformer_jax", docs_url=None, redoc_url=None)
    eot = tokenizer.token_to_id("<|endoftext|>") if tokenizer is not None else None

    def parse(body: dict) -> dict:
        args = {}
        for name, (types, default) in FIELDS.items():
            value = body.get(name, default)
            if value is not None and (not isinstance(value, types) or (bool in types) != isinstance(value, bool)):
                names = " or ".join(t.__name__ for t in types)
                raise BadRequest(f"'{name}' must be {names}, got {type(value).__name__}", name)
            args[name] = value
        if args["model"] is not None and args["model"] != model_name:
            raise BadRequest(
                f"The model '{args['model']}' does not exist; this server serves '{model_name}'", "model", 404
            )
        if args["prompt"] is None:
            raise BadRequest("'prompt' is required: text, or a list of token ids", "prompt")
        if args["echo"]:
            raise BadRequest("'echo' is not supported", "echo")
        stop = args["stop"]
        if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
            raise BadRequest("'stop' must be a string or a list of strings", "stop")
        args["stop"] = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
        if not 1 <= args["n"] <= 16:
            raise BadRequest("'n' must be between 1 and 16", "n")
        return args

    def prompts_of(prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if prompt and all(isinstance(p, str) for p in prompt):
            if tokenizer is None:
                raise BadRequest(
                    "this run trained on token ids only (no tokenizer): send 'prompt' as a list of token ids", "prompt"
                )
            return [tokenizer.encode(p, add_special_tokens=False).ids for p in prompt]
        raise BadRequest("'prompt' must be text, a list of texts or a list of token ids", "prompt")

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def submit(ids: list[int], params: SamplingParams, stops: list[str], loop, q: asyncio.Queue):
        def on_token(r, token, logprob):
            if token >= 0 and stops and any(s in decode(r.tokens) for s in stops):
                engine_thread.engine.cancel(r, "stop")  # the engine thread: end it at once
            loop.call_soon_threadsafe(q.put_nowait, (token, logprob, r.finish_reason))

        return engine_thread.submit(ids, params, on_token)

    def cut(text: str, stops: list[str]) -> str:
        for s in stops:
            if s in text:
                text = text[: text.index(s)]
        return text

    @app.get("/health")
    async def health():
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models():
        m = engine_thread.engine.model_cfg  # max_model_len as vLLM gives it; vocab_size for clients sending ids
        entry = {"id": model_name, "object": "model", "owned_by": "resformer_jax", "max_model_len": m.max_seq_len}
        return {"object": "list", "data": [{**entry, "vocab_size": m.vocab_size}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"the body is not valid JSON ({e})") from None
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            args = parse(body)
            prompts = prompts_of(args["prompt"])
            seed = args["seed"] if args["seed"] is not None else secrets.randbelow(2**31)
            stop_ids = (eot,) if eot is not None else ()
            try:
                params = [
                    SamplingParams(
                        args["max_tokens"],
                        float(args["temperature"]),
                        args["top_k"] if args["top_k"] > 0 else 0,
                        float(args["top_p"]),
                        seed + j,
                        stop_ids,
                    )
                    for j in range(args["n"])
                ]
                for ids in prompts:
                    engine_thread.engine.check(ids, params[0])
            except EngineError as e:
                raise BadRequest(str(e)) from None
        except BadRequest as e:
            return error_response(str(e), e.status, e.param)
        loop = asyncio.get_running_loop()
        queues, handles = [], []
        for ids in prompts:
            for p in params:
                q: asyncio.Queue = asyncio.Queue()
                queues.append((ids, q))
                handles.append(submit(ids, p, args["stop"], loop, q))
        rid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        if args["stream"]:
            return StreamingResponse(
                stream(rid, created, queues, handles, args),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )

        async def cancel_when_gone():  # a client that went away frees its pages at once
            while not await request.is_disconnected():
                await asyncio.sleep(0.1)
            for h in handles:
                engine_thread.cancel(h)

        watcher = asyncio.create_task(cancel_when_gone())
        try:
            choices = await asyncio.gather(*(collect(q) for _, q in queues))
        finally:
            watcher.cancel()
        out, completion_tokens = [], 0
        for i, (tokens, logprobs, reason) in enumerate(choices):
            kept = tokens[:-1] if reason == "stop" and tokens and tokens[-1] == eot else tokens
            completion_tokens += len(tokens)
            text = cut(decode(kept), args["stop"])
            out.append(
                {
                    "index": i,
                    "text": text,
                    "token_ids": kept,
                    "logprobs": logprob_record(kept, logprobs[: len(kept)]) if args["logprobs"] is not None else None,
                    "finish_reason": "stop" if reason == "stop" else "length",
                }
            )
        prompt_tokens = sum(len(ids) for ids in prompts)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": out,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def logprob_record(tokens: list[int], logprobs: list[float]) -> dict:
        return {
            "tokens": [decode([t]) if tokenizer is not None else str(t) for t in tokens],
            "token_logprobs": logprobs,
            "top_logprobs": None,
            "text_offset": None,
        }

    async def collect(q: asyncio.Queue):
        tokens, logprobs = [], []
        while True:
            token, logprob, reason = await q.get()
            if token < 0:
                return tokens, logprobs, reason
            tokens.append(token)
            logprobs.append(logprob)

    async def stream(rid, created, queues, handles, args):
        """One server-sent event a token a choice (its text delta), each choice's finish reason, then the usage
        and [DONE]. A client that goes away cancels its requests: their pages are freed at once."""
        finished = 0
        texts = ["" for _ in queues]
        tokens: list[list[int]] = [[] for _ in queues]
        merged: asyncio.Queue = asyncio.Queue()

        async def forward(i, q):
            while True:
                item = await q.get()
                await merged.put((i, *item))
                if item[0] < 0:
                    return

        tasks = [asyncio.create_task(forward(i, q)) for i, (_, q) in enumerate(queues)]
        try:
            while finished < len(queues):
                i, token, logprob, reason = await merged.get()
                choice: dict[str, Any] = {"index": i, "text": "", "logprobs": None, "finish_reason": None}
                if token >= 0 and not (token == eot and reason == "stop"):
                    tokens[i].append(token)
                    full = cut(decode(tokens[i]), args["stop"])
                    choice["text"], texts[i] = full[len(texts[i]) :], full
                    choice["token_ids"] = [token]
                    if args["logprobs"] is not None:
                        choice["logprobs"] = logprob_record([token], [logprob])
                elif token < 0:
                    finished += 1
                    choice["finish_reason"] = "stop" if reason == "stop" else "length"
                else:
                    continue  # the end-of-text token: not shown, the finish reason follows
                yield f"data: {json.dumps(chunk(rid, created, [choice]))}\n\n"
            prompt_tokens = sum(len(ids) for ids, _ in queues)
            completion = sum(len(r.tokens) for h in handles if (r := h.request) is not None)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            }
            yield f"data: {json.dumps(chunk(rid, created, [], usage=usage))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for h in handles:
                if h.request is None or not h.request.done:
                    engine_thread.cancel(h)

    def chunk(rid, created, choices, usage=None) -> dict:
        out = {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    return app
