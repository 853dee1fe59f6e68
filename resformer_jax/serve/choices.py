"""What the completion and chat endpoints share: a request's choices checked and submitted to the engine thread,
their outputs (tokens and the engine's text, stop strings applied there) arriving on a queue a choice (`Choice`),
the stream loop over every choice (`merged_outputs`), the log-probability records, the envelope and the usage."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets

from fastapi import Request
from fastapi.responses import StreamingResponse

from resformer_jax.engine import EngineError, SamplingParams
from resformer_jax.engine.engine import Finished, FinishReason, NewToken, Output, Scores
from resformer_jax.engine.sampling import bad_words_ids
from resformer_jax.serve.engine_thread import Handle
from resformer_jax.serve.protocol import FinishReason as OpenAIFinishReason
from resformer_jax.serve.protocol import (
    OpenAIModel,
    SamplingFields,
)
from resformer_jax.serve.state import BadRequest, Serving, log


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
        stop=tuple(req.stops),
        include_stop_str_in_output=req.include_stop_str_in_output,
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


@dataclasses.dataclass
class Choice:
    """One choice in flight: its prompt, its engine handle, the queue its outputs arrive on, and what they told:
    every token generated, those shown (the stop id that ended it is not, as vLLM leaves it out), the text."""

    index: int
    prompt: list[int]
    queue: asyncio.Queue
    handle: Handle | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    shown: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None  # the engine's

    def take(self, out: Output) -> None:
        if isinstance(out, NewToken):
            self.tokens.append(out.token)
            if out.shown:
                self.shown.append(out.token)
        else:
            self.finish_reason = out.reason
        self.text += out.text


def submit(s: Serving, choice: Choice, params: SamplingParams, rid: str) -> None:
    loop = asyncio.get_running_loop()

    def on_output(r, out: Output):
        with contextlib.suppress(RuntimeError):  # the event loop has closed (the server is gone): nobody waits
            loop.call_soon_threadsafe(choice.queue.put_nowait, out)

    choice.handle = s.engine_thread.submit(choice.prompt, params, on_output)
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
    choices = [Choice(i, ids, asyncio.Queue()) for i, (ids, _) in enumerate(plans)]
    for c, (_, params) in zip(choices, plans):
        submit(s, c, params, rid)
    return choices


async def collect(c: Choice) -> None:
    while True:
        out = await c.queue.get()
        c.take(out)
        if isinstance(out, Finished):
            return


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
            c.take(out)
            left -= isinstance(out, Finished)
            yield c, out
    finally:
        for t in tasks:
            t.cancel()


def event_stream(events) -> StreamingResponse:
    """Server-sent events, as OpenAI streams them."""
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"
