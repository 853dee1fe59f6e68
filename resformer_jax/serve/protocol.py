"""The request models of the OpenAI-compatible API, as OpenAI and vLLM define them (pydantic): what each endpoint
reads, its defaults and its bounds. A field a model does not declare is accepted and named in one warning line,
as vLLM does; a value of the wrong type or out of bounds is a 400 in OpenAI's error shape (app.py)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: alternatives a position at most


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(OpenAIModel):
    include_usage: bool = False  # a last chunk with the usage (choices: [])


class SamplingFields(OpenAIModel):
    """What completions and chat completions share: the model, sampling and stopping."""

    model: str | None = None
    temperature: float | None = Field(1.0, ge=0)
    top_p: float | None = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(0, ge=-1)  # vLLM's: 0 or -1 off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = Field(0, ge=0)  # stops (the end-of-text token, stop strings) do not end a request before it
    ignore_eos: bool = False  # the end-of-text token does not end the request
    stop_token_ids: list[int] | None = None  # vLLM's: these ids end the request too (not shown, as end-of-text)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string (or stop id) that ended it kept in the text
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)  # OpenAI's: once a token is in the output
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)  # OpenAI's: per time a token is in the output
    repetition_penalty: float | None = Field(1.0, gt=0, allow_inf_nan=False)  # vLLM's: prompt and output, > 1 less
    min_p: float | None = Field(0.0, ge=0, le=1)  # vLLM's: a token at least min_p times the most likely's probability
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> added to its logit, [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: only these ids may be generated
    bad_words: list[str] | None = None  # vLLM's: words never generated (the last token of each masked once due)

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """The bias as (token id, bias) pairs, each bias clipped to [-100, 100] (OpenAI's range; vLLM clips too)."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias key {key!r}: must be a token id (an integer as a string)") from None
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias[{key!r}]={bias!r}: must be a finite number")
            pairs.append((token, min(100.0, max(-100.0, float(bias)))))
        return tuple(pairs)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in (self.stop or []) if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a prompt as text, a list of texts, token ids or a list of token-id lists."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # None: up to the model's context; 0 with echo: score the prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text (a list of parts: their text parts joined)."""
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: messages rendered by the chat template, then completed."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template: str | None = None  # a template for this request instead of the server's


class TokenizeRequest(OpenAIModel):
    """POST /tokenize (vLLM's): text, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


FinishReason = Literal["stop", "length", "abort"]
