"""The planted-bug check itself (``tests/planted.py``): it passes only when the machine
detects the planted bug, never when the planted stub merely fails to run."""

from __future__ import annotations

import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from tests.planted import assert_machine_catches


class Counter:
    def add(self, n: int) -> int:
        return n


class CounterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.counter, self.total = Counter(), 0

    @rule()
    def add_one(self) -> None:
        self.total += self.counter.add(1)

    @invariant()
    def counts_every_addition(self) -> None:
        assert self.total >= 0, "the total went negative"


def test_a_planted_bug_the_machine_detects_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_machine_catches(monkeypatch, CounterMachine, Counter, "add", lambda self, n: -n, 5)


def test_a_planted_stub_with_the_wrong_signature_fails_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(AssertionError, match="not a detected violation"):
        assert_machine_catches(monkeypatch, CounterMachine, Counter, "add", lambda self: -1, 5)
