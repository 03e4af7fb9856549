"""reducers/work.py: the step's own work (hits of its admissions) and the serving state."""

from __future__ import annotations

from tests.policy.helpers import Harness, request, tokens

from kvsched.events import types as ev

PROMPT = tokens(70, seed=7)


def test_the_steps_hits_are_those_of_its_own_admissions_only():
    h = Harness()
    h.step([request(1, PROMPT, max_tokens=1)])
    assert h.state.work.step_hits() == (0, 70)
    h.run_until_idle()
    h.step([request(2, PROMPT, max_tokens=1)])
    assert h.state.work.step_hits() == (64, 70)


def test_a_drain_puts_the_engine_to_sleep_and_a_wake_ends_it():
    h = Harness()
    h.step([ev.DrainRequested()])
    h.run_until_idle()
    assert h.state.sleeping
    h.step([ev.WakeRequested()])
    assert not h.state.sleeping
