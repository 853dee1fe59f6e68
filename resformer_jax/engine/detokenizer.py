"""A request's text as its tokens arrive, as vLLM's incremental detokenizer builds it: each token's new text
decoded from a window of the last few tokens, and stop strings looked for only where new text could complete one,
so a token costs the same at the 2,000th as at the first (not a decode of the whole output each time). The stop
strings' rules live here alone (`OutputText`: where a text ends, and what may be sent before a stop string is ruled
out); the engine applies them to each request, and the server and the lm-eval adapter read its text."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalText:
    """`add(token)` returns the token's new text; `text` is all of it so far. A token that ends inside a UTF-8
    character adds nothing until the character is whole. `decode(ids)` is the tokenizer's."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # the window: ids[_prefix:_read] is decoded already, the rest is new

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


class OutputText:
    """A request's text as the engine produces it (vLLM's detokenizer in its output processor): `add(token)` appends
    the token's text and, with `stopping` (from min_tokens on), looks for a stop string only where the new text
    could complete one; the text ends there (through it with `keep`, vLLM's include_stop_str_in_output). `delta()`
    gives the text not sent yet, holding back the last len(longest stop) - 1 characters while a stop string could
    still begin in them; `delta(final=True)` (and any delta after a stop) gives all of it. `offset`: where the latest
    token's text begins."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = (), keep: bool = False):
        self.stops, self.keep = tuple(x for x in stops if x), keep
        self.longest = max((len(x) for x in self.stops), default=0)
        self.text = ""
        self.offset = 0
        self.stopped = False
        self._decoded = IncrementalText(decode)
        self._sent = 0  # text[:_sent] has been handed out

    def add(self, token: int, stopping: bool = True) -> bool:
        """True once a stop string has ended the text."""
        self.offset = len(self.text)
        new = self._decoded.add(token)
        self.text = self._decoded.text
        if stopping and new and self.stops:
            start = len(self.text) - len(new) + 1  # a stop string found must end in the new text
            found = [(at, x) for x in self.stops if (at := self.text.find(x, max(0, start - len(x)))) >= 0]
            if found:
                at, stop = min(found)
                self.text, self.stopped = self.text[: at + len(stop) * self.keep], True
        return self.stopped

    def delta(self, final: bool = False) -> str:
        end = len(self.text)
        if not (final or self.stopped):
            end = max(self._sent, end - max(self.longest - 1, 0))
        out, self._sent = self.text[self._sent : end], end
        return out
