"""Incremental detokenisation: the text each new token adds, never split inside a UTF-8 character, and stop
strings found in the text (the text up to the stop string is delivered, the stop string itself is not)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Byte-level BPE tokens can end inside a multi-byte character; decoding such a prefix gives U+FFFD.
REPLACEMENT_CHARACTER = "\ufffd"
# Tokens before the newest ones that are re-decoded with them, so that a tokenizer's merge of spaces or
# byte sequences across token boundaries is decoded as in the whole text.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas (as vLLM's incremental detokeniser does: decode a
    short window of tokens before and including the new ones, emit what it adds to the window without them).

    With stop strings, text that could still be the beginning of one is held back until it is not."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens whose text is already in self._text
        self._text = ""  # decoded so far (including held-back text)
        self._emitted = 0  # characters of self._text delivered
        self.stopped_on: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int], stops_allowed: bool = True) -> str:
        """Add new tokens; returns the text they complete that can be delivered now ('' while a character
        or a possible stop string is incomplete). After a stop string, returns '' and `stopped_on` is set.
        With `stops_allowed` False (before min_tokens) the text is delivered whole and no stop is sought."""
        if self.stopped_on is not None:
            return ""
        self.token_ids.extend(int(t) for t in token_ids)
        window = self.token_ids[self._prefix_offset :]
        before = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        text = self._decode(window)
        if len(text) > len(before) and not text.endswith(REPLACEMENT_CHARACTER):
            self._text += text[len(before) :]
            self._read_offset = len(self.token_ids)
            self._prefix_offset = max(0, self._read_offset - CONTEXT_TOKENS)
        if not stops_allowed:
            return self.flush()
        return self._deliverable()

    def _deliverable(self) -> str:
        end = len(self._text)
        for stop in self.stop:
            # Search from the first character a new stop string could involve.
            found = self._text.find(stop, max(0, self._emitted - len(stop) + 1))
            if found != -1 and found < end:
                end, self.stopped_on = found, stop
        if self.stopped_on is None:
            # Hold back a tail that is the beginning of a stop string.
            for stop in self.stop:
                for size in range(min(len(stop) - 1, len(self._text) - self._emitted), 0, -1):
                    if self._text.endswith(stop[:size]):
                        end = min(end, len(self._text) - size)
                        break
        delta = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever was held back for a stop string that never came."""
        if self.stopped_on is not None:
            return ""
        delta = self._text[self._emitted :]
        self._emitted = len(self._text)
        return delta

    @property
    def text(self) -> str:
        """The text delivered so far."""
        return self._text[: self._emitted]
