"""Planted-bug checks: a state machine must detect a deliberately broken method."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test


def assert_machine_catches(
    monkeypatch: pytest.MonkeyPatch,
    machine: type[RuleBasedStateMachine],
    target: object,
    name: str,
    broken: object,
    max_examples: int = 150,
) -> None:
    """Replace ``target.name`` with ``broken``; ``machine`` must then fail within
    ``max_examples`` derandomised examples."""
    monkeypatch.setattr(target, name, broken)
    with pytest.raises(Exception):  # noqa: B017 - any detected violation will do
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=max_examples,
                stateful_step_count=30,
                deadline=None,
                database=None,
                derandomize=True,
                print_blob=False,
                phases=[Phase.generate],  # finding the planted bug is enough: no shrinking
            ),
        )
