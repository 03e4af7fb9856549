"""reducers/state.py: ``EngineState``, the owners behind one ``apply`` and its queries."""

from __future__ import annotations

import pytest
from tests.policy.helpers import Harness, config, request

from kvsched.events import types as ev
from kvsched.reducers.inputs import InputError
from kvsched.reducers.state import EngineState


def test_an_empty_engine_has_no_work_and_an_arrival_gives_it_some():
    h = Harness()
    assert not h.state.has_work
    h.step([request(1, 20)])
    assert h.state.has_work and h.state.seq(1).seq_id == 1


def test_two_engines_fed_the_same_inputs_hold_the_same_state():
    a, b = Harness(), Harness()
    for h in (a, b):
        h.step([request(1, 40), request(2, 25)])
        h.step()
    assert a.state.snapshot() == b.state.snapshot()


def test_a_decision_given_as_an_input_is_refused_before_anything_changes():
    state = EngineState(config())
    before = state.snapshot()
    with pytest.raises(InputError):
        state.check_inputs([request(1, 20), ev.CacheCleared()])
    assert state.snapshot() == before


def test_every_held_block_is_listed_by_its_holder():
    h = Harness()
    h.step([request(1, 40)])
    held = sorted(int(b) for blocks in h.state.holders() for b in blocks)
    assert len(held) == 3 and len(set(held)) == 3
