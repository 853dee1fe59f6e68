"""POST /v1/chat/completions: the messages rendered by the chat template (Jinja, as vLLM renders it), then one or n
choices as completions run them, in chat's shapes (message or delta, content logprobs)."""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import APIRouter, Request

from resformer_jax.engine.engine import NewToken, Scores
from resformer_jax.serve.choices import (
    Logprobs,
    check_model,
    envelope,
    event_stream,
    finished,
    merged_outputs,
    reason_of,
    scores_of,
    sse,
    start,
    until_done_or_gone,
    usage,
)
from resformer_jax.serve.protocol import (
    ChatCompletionRequest,
)
from resformer_jax.serve.state import BadRequest, Serving, serving_of

router = APIRouter()


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
        kept = c.shown
        entry: dict[str, Any] = {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
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
                if not out.shown:
                    continue  # the stop id that ends it: the finish reason follows
                entry["delta"] = {"content": out.text}
                if n_top is not None:
                    ids = prompt + c.shown
                    entry["logprobs"] = chat_logprobs(s, scores_of(c), ids, len(ids) - 1, n_top)
            else:
                entry["delta"] = {"content": out.text} if out.text else {}
                entry["finish_reason"] = reason_of(out.reason)
            yield sse(chunk([entry]))
        if req.include_usage:
            yield sse(chunk([], usage=usage([prompt], choices)))
        yield "data: [DONE]\n\n"
    finally:
        finished(s, choices)
