"""What every route of the server reads (`Serving`, on `app.state.serving`) and how a bad request is answered:
`BadRequest`, raised anywhere, becomes an OpenAI-style JSON error (400; 404 for another model) and one log line."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from resformer_jax.serve.engine_thread import EngineThread
from resformer_jax.serve.metrics import ServeMetrics

log = logging.getLogger("resformer_jax.serve")


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


def serving_of(request: Request) -> Serving:
    return request.app.state.serving
