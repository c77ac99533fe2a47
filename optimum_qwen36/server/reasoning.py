"""Qwen3.5 / Qwen3.6 reasoning: the chat template opens `<think>` in the prompt, so the model writes its
reasoning, then `</think>`, then the answer. This parser splits generated text into reasoning and content,
whole or as stream deltas, at whatever points the text is cut.

A `<tool_call>` that starts before `</think>` also ends the reasoning (the model called a tool without
closing its thoughts): the call goes to the content, where the tool-call parser finds it, instead of being
lost inside the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether generation starts inside a reasoning block: the prompt's last `<think>` is not closed (the
    template's thinking mode; with thinking off it writes an empty, closed block)."""
    start = prompt.rfind(THINK_START)
    return start != -1 and prompt.find(THINK_END, start) == -1


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is the beginning of one of `markers` (and could become
    it with the next delta)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


@dataclass
class Split:
    """Text split into what the model reasoned and what it answered."""

    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: Split) -> Split:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningParser:
    """Feed text deltas in order; each `feed` returns the reasoning and content they complete. Text that
    could be the beginning of `</think>` (or `<tool_call>`) is held back until it is known. `finish()`
    returns what is held back at the end."""

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self._pending = ""
        self._content_started = False  # the newlines after `</think>` are the template's, not the answer's

    def feed(self, delta: str) -> Split:
        text = self._pending + delta
        self._pending = ""
        split = Split()
        if self.in_reasoning:
            end, start = text.find(THINK_END), text.find(TOOL_CALL_START)
            if end != -1 and (start == -1 or end < start):
                split.reasoning, text = text[:end], text[end + len(THINK_END) :]
                self.in_reasoning = False
            elif start != -1:
                split.reasoning, text = text[:start], text[start:]
                self.in_reasoning = False
            else:
                keep = held_back(text, (THINK_END, TOOL_CALL_START))
                split.reasoning, self._pending = text[: len(text) - keep], text[len(text) - keep :]
                return split
        if not self._content_started:
            text = text.lstrip("\n")
            self._content_started = bool(text)
        split.content = text
        return split

    def finish(self) -> Split:
        """The held-back tail: it never became a marker."""
        text, self._pending = self._pending, ""
        return Split(reasoning=text) if self.in_reasoning else Split(content=text)

    def parse(self, text: str) -> Split:
        """The whole text at once."""
        split = self.feed(text)
        split += self.finish()
        return split
