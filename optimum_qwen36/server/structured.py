"""Structured output (`response_format` json_object / json_schema) with llguidance: a grammar matcher per
request, applied by the engine as a `TokenConstraint` (a mask of the tokens the grammar allows next).

With thinking on, the grammar starts after `</think>`: the reasoning is free text, the answer is the JSON.
The reasoning cannot end the text (the tokens that would are held back until `</think>`), so a constrained
answer always comes, or the text ends by length.

A constraint sent to another process (a tensor-parallel worker runs the same engine call) travels as its
grammar and where its tokenizer came from, and is rebuilt there with a fresh matcher: llguidance's matchers
cannot be pickled, and every rank must apply the same grammar to the same tokens.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..tokenizer import load_qwen36_tokenizer
from .errors import bad_request

logger = logging.getLogger(__name__)

try:
    import llguidance
    import llguidance.hf
    import llguidance.torch
except ImportError:  # an optional dependency: `pip install optimum-qwen36[serve]` brings it
    llguidance = None


@dataclass(frozen=True)
class Grammar:
    """A grammar as requested (`kind` "json_schema": a JSON schema's text; "lark": llguidance's lark dialect)
    and the directory its tokenizer was loaded from (None: a tokenizer built in memory), which another
    process loads to rebuild the constraint."""

    kind: str
    text: str
    tokenizer_dir: str | None
    tokenizer_size: int


@dataclass(frozen=True)
class Gate:
    """Where a grammar starts: after `token_id` (`</think>`); until then any token but `held` (the tokens
    that would end the text or start an answer inside the reasoning)."""

    token_id: int
    held: tuple[int, ...] = ()


class GrammarConstraint:
    """The tokens an llguidance grammar allows next; with a `gate`, enforced only after its token."""

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        eos_token_id: int,
        gate: Gate | None = None,
        grammar: Grammar | None = None,
    ) -> None:
        self.matcher = matcher
        self.grammar = grammar
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.gate = gate
        self._open = gate is None
        self._before_gate: torch.Tensor | None = None
        if gate is not None and gate.held:
            self._before_gate = torch.ones(vocab_size, dtype=torch.bool)
            self._before_gate[[t for t in gate.held if 0 <= t < vocab_size]] = False
        self._accepted = False  # a rebuilt constraint starts before any token
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self._bits = torch.arange(32, dtype=torch.int32)

    def __reduce__(self) -> Any:
        if self.grammar is None or self.grammar.tokenizer_dir is None:
            raise TypeError(
                "a grammar constraint is sent to another process (tensor parallelism) as its grammar and "
                "the directory its tokenizer was loaded from, and this tokenizer was not loaded from a "
                "directory: serve a model whose tokenizer files are in its directory, or use tp_degree=1"
            )
        if self._accepted:
            raise TypeError("a grammar constraint that has accepted tokens cannot be sent to another process")
        return rebuild_constraint, (self.grammar, self.vocab_size, self.eos_token_id, self.gate)

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        if not self._open:
            return None if self._before_gate is None else self._before_gate[:vocab_size]
        try:
            if not self.matcher.is_error():
                llguidance.torch.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
                words = self._bitmask[0]
                allowed = ((words[:, None] >> self._bits) & 1).bool().flatten()[:vocab_size]
                if allowed.any():
                    return allowed
        except Exception:  # a matcher failure ends this request, never the engine's step
            logger.exception("The grammar matcher failed: ending the request")
        only_eos = torch.zeros(vocab_size, dtype=torch.bool)
        only_eos[self.eos_token_id] = True
        return only_eos

    def accept(self, token_id: int) -> None:
        self._accepted = True
        if not self._open:
            self._open = token_id == self.gate.token_id
            return
        try:
            self.matcher.consume_token(token_id)
        except Exception:  # allowed_tokens then allows only EOS
            logger.exception("The grammar matcher failed on token %d", token_id)


class StructuredOutput:
    """Builds constraints for one tokenizer; the llguidance tokenizer is made on first use (seconds)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        # Where another process loads the same tokenizer from (a rebuilt constraint), if from a directory.
        source = getattr(tokenizer, "name_or_path", None)
        self._tokenizer_dir = str(Path(source).resolve()) if source and Path(source).is_dir() else None
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None

    @property
    def available(self) -> bool:
        return llguidance is not None

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer now (it takes seconds)."""
        if self.available:
            self._tokenizer()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id
                )
            return self._ll_tokenizer

    def json_constraint(self, schema: dict[str, Any], gate: Gate | None) -> GrammarConstraint:
        """Output that is JSON valid under `schema`."""
        return self.constraint(self._grammar("json_schema", json.dumps(schema)), gate, "response_format")

    def lark_constraint(self, grammar: str, gate: Gate | None, param: str) -> GrammarConstraint:
        """Output in the language of a lark grammar (llguidance's dialect), built from the request's
        `param`."""
        return self.constraint(self._grammar("lark", grammar), gate, param)

    def _grammar(self, kind: str, text: str) -> Grammar:
        return Grammar(kind, text, self._tokenizer_dir, len(self.tokenizer))

    def constraint(
        self, grammar: Grammar, gate: Gate | None, param: str = "response_format"
    ) -> GrammarConstraint:
        """A fresh matcher for `grammar`; bad grammars are the client's error (HTTP 400 naming `param`)."""
        if not self.available:
            raise bad_request(
                "Structured output needs llguidance, which is not installed: pip install llguidance.", param
            )
        try:
            if grammar.kind == "json_schema":
                text = llguidance.LLMatcher.grammar_from_json_schema(grammar.text)
            else:
                text = llguidance.grammar_from("lark", grammar.text)
            matcher = llguidance.LLMatcher(self._tokenizer(), text)
        except ValueError as error:
            raise bad_request(f"Unusable grammar or JSON schema: {error}", param) from error
        if matcher.is_error():
            raise bad_request(f"Unusable grammar or JSON schema: {matcher.get_error()}", param)
        return GrammarConstraint(matcher, self.vocab_size, self.eos_token_id, gate, grammar)


# This process's StructuredOutput per (tokenizer directory, vocab size, EOS): rebuilt constraints share it.
_rebuilders: dict[tuple[str, int, int], StructuredOutput] = {}
_rebuilders_lock = threading.Lock()


def rebuild_constraint(
    grammar: Grammar, vocab_size: int, eos_token_id: int, gate: Gate | None
) -> GrammarConstraint:
    """`grammar`'s constraint in this process, with a fresh matcher (as the sender's was before any token),
    against this process's copy of the sender's tokenizer."""
    assert grammar.tokenizer_dir is not None
    key = (grammar.tokenizer_dir, vocab_size, eos_token_id)
    with _rebuilders_lock:
        structured = _rebuilders.get(key)
        if structured is None:
            tokenizer = load_qwen36_tokenizer(grammar.tokenizer_dir)
            if len(tokenizer) != grammar.tokenizer_size:
                raise ValueError(
                    f"the tokenizer in {grammar.tokenizer_dir} has {len(tokenizer)} tokens here and "
                    f"{grammar.tokenizer_size} in the process that sent the grammar: they must be the same "
                    "files"
                )
            structured = _rebuilders[key] = StructuredOutput(tokenizer, vocab_size, eos_token_id)
    return structured.constraint(grammar, gate)
