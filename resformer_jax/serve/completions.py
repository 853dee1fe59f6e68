"""POST /v1/completions: a prompt as text, texts, token ids or lists of them; n choices a prompt, echo and logprobs,
streamed as server-sent events or not."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request

from resformer_jax.engine.engine import NewToken
from resformer_jax.serve.choices import (
    Choice,
    Logprobs,
    check_model,
    envelope,
    event_stream,
    finished,
    logprobs_record,
    merged_outputs,
    prompts_of,
    reason_of,
    scores_of,
    sse,
    start,
    until_done_or_gone,
    usage,
)
from resformer_jax.serve.protocol import (
    CompletionRequest,
)
from resformer_jax.serve.state import BadRequest, Serving, serving_of

router = APIRouter()


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
        kept, text = c.shown, c.text
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
                    if not out.shown:
                        continue  # the stop id that ends it: the finish reason follows
                    entry["text"], entry["token_ids"] = out.text, [out.token]
                    if req.logprobs is not None:  # this token's, over the prompt and what came before it
                        ids, offset = c.prompt + c.shown, prompt_chars[c.index] + out.offset
                        entry["logprobs"] = logprobs_record(s, scores_of(c), ids, len(ids) - 1, req.logprobs, offset)
                else:
                    entry["text"], entry["finish_reason"] = out.text, reason_of(out.reason)
                yield sse(chunk([entry]))
        else:
            for c in choices:
                yield sse(chunk([{"index": c.index, "text": "", "logprobs": None, "finish_reason": "length"}]))
        if req.include_usage:
            yield sse(chunk([], usage=usage(prompts, choices)))
        yield "data: [DONE]\n\n"
    finally:
        finished(s, choices)
