"""``CountingGrammars``: a structured-output manager for the scheduler-level harness (no
tokenizer, no grammar backend), which both vLLM's schedulers and kvsched's adapter are given
(``NoGrammar``: the one given when no structured output is requested).

Each structured request's grammar counts the tokens it has accepted. A bitmask request
records, per row, the request and how many tokens its grammar had accepted at that moment
and how many drafts the row verifies: under vLLM's async scheduling a structured row whose
tokens are still out must get its bitmask only after they have been accepted (the engine
core defers sampling: ``pending_structured_output_tokens``), so two schedulers that defer
alike record the same calls. A draft whose token is a multiple of ``reject_every`` is one the
grammar does not allow (``validate_tokens`` cuts the drafts there), so drafts are both kept
and cut. The model's tokens are always allowed (the harness's model obeys every grammar).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["CountingGrammar", "CountingGrammars", "NoGrammar"]


class CountingGrammar:
    def __init__(self) -> None:
        self.accepted = 0

    def is_terminated(self) -> bool:
        return False


class CountingGrammars:
    def __init__(self, reject_every: int = 5) -> None:
        self.reject_every = reject_every
        self.calls: list[list[tuple[str, int, int]]] = []  # per bitmask: (name, accepted, drafts)

    def grammar_init(self, request: Any) -> None:
        """The engine core's call when a structured request arrives (compiled at once)."""
        if request.structured_output_request is not None:
            request.structured_output_request.grammar = CountingGrammar()

    def accept_tokens(self, request: Any, tokens: list[int]) -> bool:
        if request.structured_output_request is not None:  # (vLLM asks for every request)
            request.structured_output_request.grammar.accepted += len(tokens)
        return True

    def validate_tokens(self, request: Any, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t % self.reject_every == 0:
                return list(tokens[:i])
        return list(tokens)

    def grammar_bitmask(
        self, requests: dict[str, Any], names: list[str], spec: dict[str, list[int]]
    ) -> np.ndarray:
        call = []
        for name in names:
            drafts = spec.get(name, [])
            kept = next((i for i, t in enumerate(drafts) if t < 0), len(drafts))
            grammar = requests[name].structured_output_request.grammar
            call.append((name, grammar.accepted, kept))
        self.calls.append(call)
        return np.zeros((sum(1 + c[2] for c in call), 1), np.int32)

    def clear_backend(self) -> None:
        return None


class NoGrammar:
    """The structured-output manager's surface vLLM's scheduler touches (none requested)."""

    def grammar_init(self, request: Any) -> None:
        return None

    def accept_tokens(self, request: Any, tokens: Any) -> bool:
        return True

    def validate_tokens(self, request: Any, tokens: list[int]) -> list[int]:
        return tokens
