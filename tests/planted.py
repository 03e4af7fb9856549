"""Planted-bug checks: a state machine must detect a deliberately broken method."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from kvsched.reducers.errors import ReplayMismatch
from kvsched.reducers.inputs import InputError
from kvsched.statemachines import IllegalTransition

# What a detected violation raises: an assertion or invariant (InvariantError is an
# AssertionError), an event the state cannot fold, an illegal lifecycle transition, an input
# (an executor's or store's report built from the plan) the engine's state refuses. Anything
# else (a TypeError from a stub whose signature does not match, an AttributeError) is the
# planted stub failing, not the machine catching the bug it plants.
DETECTED = (AssertionError, ReplayMismatch, IllegalTransition, InputError)


def assert_machine_catches(
    monkeypatch: pytest.MonkeyPatch,
    machine: type[RuleBasedStateMachine],
    target: object,
    name: str,
    broken: object,
    max_examples: int = 150,
) -> None:
    """Replace ``target.name`` with ``broken``; ``machine`` must then fail within
    ``max_examples`` derandomised examples, with a detected violation (``DETECTED``)."""
    monkeypatch.setattr(target, name, broken)
    with pytest.raises(Exception) as caught:
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
    error = caught.value
    errors = error.exceptions if isinstance(error, BaseExceptionGroup) else (error,)
    wrong = [e for e in errors if not _detected(e)]
    if wrong:
        raise AssertionError(
            f"the planted {name} failed with {wrong[0]!r}, not a detected violation "
            "(does the stub match the method it replaces?)"
        ) from wrong[0]


def _detected(error: BaseException | None) -> bool:
    """Whether ``error`` or one it was raised while handling is a detected violation (a
    teardown after the failure meets a halted engine: ``EngineHalted``, raised in handling
    the violation that halted it)."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, DETECTED):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False
