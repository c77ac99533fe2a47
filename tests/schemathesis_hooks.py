"""schemathesis hooks for tests/test_server_fuzz.py (loaded by the CLI through SCHEMATHESIS_HOOKS): every
generated request body, in every phase, names the served model (so requests get past the model check to
what they test) and asks for one token (the fuzz run tests what the server accepts and answers,
not long generations)."""

from __future__ import annotations

import os

import schemathesis

MAX_TOKENS = 1  # the first token only: no decode step (streams still carry role, text, finish, usage)
_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    body, path = case.body, case.operation.path
    if not isinstance(body, dict) or case.operation.method.upper() != "POST":
        return case
    if path.endswith(("completions", "responses")):
        body["model"] = os.environ["FUZZ_MODEL"]
        limits = [key for key in _LIMITS if key in body]
        for key in limits:
            if type(body[key]) is int and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS
        if not limits:
            body["max_output_tokens" if path.endswith("responses") else "max_tokens"] = MAX_TOKENS
    return case
