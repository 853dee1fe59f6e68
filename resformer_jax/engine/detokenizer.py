"""A request's text as its tokens arrive, as vLLM's incremental detokenizer builds it: each token's new text
decoded from a window of the last few tokens, and stop strings looked for only where new text could complete one,
so a token costs the same at the 2,000th as at the first (not a decode of the whole output each time)."""

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
