"""Structured output (`response_format` json_object / json_schema) with llguidance: a grammar matcher per
request, applied by the engine as a `TokenConstraint` (a mask of the tokens the grammar allows next).

With thinking on, the grammar starts after `</think>`: the reasoning is free text, the answer is the JSON.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from .errors import bad_request

logger = logging.getLogger(__name__)

try:
    import llguidance
    import llguidance.hf
    import llguidance.torch
except ImportError:  # an optional dependency: `pip install optimum-qwen36[serve]` brings it
    llguidance = None


class GrammarConstraint:
    """The tokens an llguidance grammar allows next; `gate_token_id`: enforce only after that token."""

    def __init__(
        self, matcher: Any, vocab_size: int, eos_token_id: int, gate_token_id: int | None = None
    ) -> None:
        self.matcher = matcher
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.gate_token_id = gate_token_id
        self._open = gate_token_id is None
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self._bits = torch.arange(32, dtype=torch.int32)

    def __reduce__(self) -> Any:
        raise TypeError(
            "an llguidance grammar matcher cannot be sent to another process: structured output "
            "(response_format, tool_choice 'required' or a named function) does not run with tp_degree > 1 "
            "yet"
        )

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        if not self._open:
            return None
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
        if not self._open:
            self._open = token_id == self.gate_token_id
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

    def json_constraint(self, schema: dict[str, Any], gate_token_id: int | None) -> GrammarConstraint:
        """Output that is JSON valid under `schema`."""
        return self._constraint(
            lambda: llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)), gate_token_id
        )

    def lark_constraint(self, grammar: str, gate_token_id: int | None) -> GrammarConstraint:
        """Output in the language of a lark grammar (llguidance's dialect)."""
        return self._constraint(lambda: llguidance.grammar_from("lark", grammar), gate_token_id)

    def _constraint(self, grammar: Callable[[], str], gate_token_id: int | None) -> GrammarConstraint:
        if not self.available:
            raise bad_request(
                "Structured output needs llguidance, which is not installed: pip install llguidance.",
                "response_format",
            )
        try:
            matcher = llguidance.LLMatcher(self._tokenizer(), grammar())
        except ValueError as error:
            raise bad_request(f"Unusable grammar or JSON schema: {error}", "response_format") from error
        if matcher.is_error():
            raise bad_request(f"Unusable grammar or JSON schema: {matcher.get_error()}", "response_format")
        return GrammarConstraint(matcher, self.vocab_size, self.eos_token_id, gate_token_id)
