"""The OpenAI-compatible app, in FastAPI's idiom (module-level routes, pydantic request models: serve/protocol.py):
POST /v1/completions and /v1/chat/completions (streamed as server-sent events or not), GET /v1/models, vLLM's POST
/tokenize and /detokenize and GET /tokenizer_info, GET /health, GET /metrics. Bad input is an OpenAI-style JSON
error (400; 404 for another model), one line in the log, and the server goes on. What the routes share lives in
`Serving`, on `app.state.serving` (serve/state.py); the two generating endpoints are serve/completions.py and
serve/chat.py, over one stream loop and the choices' bookkeeping (serve/choices.py); the small routes are here."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from resformer_jax.serve import chat, completions
from resformer_jax.serve.chat import render_chat
from resformer_jax.serve.choices import check_model
from resformer_jax.serve.engine_thread import EngineThread
from resformer_jax.serve.metrics import ServeMetrics
from resformer_jax.serve.protocol import DetokenizeRequest, TokenizeRequest
from resformer_jax.serve.state import BadRequest, Serving, error_response, serving_of

router = APIRouter()


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
    for routes in (router, completions.router, chat.router):
        app.include_router(routes)
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
