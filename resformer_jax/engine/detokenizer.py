"""A request's text as its tokens arrive, as vLLM's incremental detokenizer builds it: each token's new text
decoded from a window of the last few tokens, and stop strings looked for only where new text could complete one,
so a token costs the same at the 2,000th as at the first (not a decode of the whole output each time). The stop
strings' rules live here alone: where a text ends (`cut`), and what a stream may send before it knows (`StopText`,
the hold-back); the server and the lm-eval adapter call them."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalText:
    """`add(token)` returns the token's new text; `text` is all of it so far. A token that ends inside a UTF-8
    character adds nothing until the character is whole. `decode(ids)` is the tokenizer's."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decode, self.stops = decode, tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # the window: ids[_prefix:_read] is decoded already, the rest is new
        self._searched = 0  # text[:_searched] has been searched for stop strings

    def add(self, token: int) -> str:
        self.ids.append(token)
        # decoded from the same start, so a decoder that treats a sequence's first token apart treats both alike
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new

    def stop_found(self) -> bool:
        """Whether a stop string ends in the text added since the last call; the first call searches all of it, so a
        caller may start calling at min_tokens."""
        since, self._searched = self._searched, len(self.text)
        return any(self.text.find(s, max(0, since - len(s) + 1)) >= 0 for s in self.stops)


def cut(text: str, stops: Sequence[str], keep: bool = False) -> str:
    """The text before its first stop string (keep: through it, vLLM's include_stop_str_in_output)."""
    found = [(text.index(stop), stop) for stop in stops if stop and stop in text]
    if not found:
        return text
    at, stop = min(found)
    return text[: at + len(stop) * keep]


class StopText:
    """A streamed request's shown text under its stop strings, as vLLM's detokenizer sends it: `add(token)` gives
    the token's new text, holding back the last len(longest stop) - 1 characters until no stop string can begin
    there; `rest()` gives what was held back, with the end. `shown` are the tokens added; `offset` where the latest
    one's text begins."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = (), keep: bool = False):
        self.decode, self.stops, self.keep = decode, [x for x in stops if x], keep
        self.shown: list[int] = []
        self.offset = 0
        self._text = IncrementalText(decode)
        self._sent = ""  # the text sent so far, cut at a stop string

    def add(self, token: int) -> str:
        self.shown.append(token)
        self.offset = len(self._text.text)
        self._text.add(token)
        decoded = self._text.text
        full = cut(decoded, self.stops, self.keep)
        if self.stops and full == decoded:  # no stop string yet
            full = full[: max(len(self._sent), len(full) - max(len(x) for x in self.stops) + 1)]
        delta, self._sent = full[len(self._sent) :], full
        return delta

    def rest(self) -> str:
        full = cut(self.decode(self.shown), self.stops, self.keep)
        rest, self._sent = full[len(self._sent) :], full
        return rest
