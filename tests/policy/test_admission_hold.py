"""Held admissions (``AdmissionsHeld``, vLLM's ``PAUSED_NEW``): what runs goes on, nothing
waiting is admitted until the hold is lifted."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.events import types as ev
from kvsched.events.codec import decode_events, encode

from .helpers import Harness, admitted, of_type, request


def test_while_admissions_are_held_a_running_sequence_decodes_and_nothing_waiting_is_admitted():
    h = Harness()
    h.step([request(0, 40, max_tokens=6)])
    result = h.step([ev.AdmissionsHeld(), request(1, 40, max_tokens=3)])
    assert admitted(result) == []
    for _ in range(3):
        result = h.step()
        assert admitted(result) == []
        assert of_type(result.decisions, ev.DecodeScheduled)  # sequence 0 goes on
    assert 1 in h.state.seqs.waiting


def test_a_held_engine_with_only_waiting_sequences_has_no_work_until_the_hold_is_lifted():
    h = Harness()
    h.step([ev.AdmissionsHeld(), request(0, 40, max_tokens=2)])
    assert not h.engine.has_work and 0 in h.state.seqs.waiting
    result = h.step([ev.AdmissionsHeld(held=False)])
    assert admitted(result) == [0]
    h.run_until_idle()
    assert h.state.stats.requests_finished == 1


def test_a_sequence_preempted_while_admissions_are_held_is_not_readmitted_until_lifted():
    h = Harness()
    h.step([request(0, 40, max_tokens=8)])
    h.step([ev.AdmissionsHeld()])
    h.step([ev.DrainRequested()])  # preempts it: it waits again
    h.step([ev.WakeRequested()])
    assert all(admitted(h.step()) == [] for _ in range(3))
    assert admitted(h.step([ev.AdmissionsHeld(held=False)])) == [0]


@pytest.mark.parametrize("held", [True, False])
def test_a_hold_round_trips_through_the_log_codec(held: bool):
    event = ev.AdmissionsHeld(held=held)
    assert decode_events(encode([event])) == [event]


def test_holding_twice_is_one_hold_and_a_lift_without_a_hold_changes_nothing():
    h = Harness()
    h.step([ev.AdmissionsHeld(held=False)])
    h.step([ev.AdmissionsHeld(), ev.AdmissionsHeld()])
    assert h.state.serving.admissions_held
    h.step([ev.AdmissionsHeld(held=False)])
    assert not h.state.serving.admissions_held
    assert np.array_equal(h.state.pool.ref, np.zeros_like(h.state.pool.ref))


def test_while_everything_is_held_nothing_is_scheduled_and_what_ran_resumes_after():
    h = Harness()
    h.step([request(0, 40, max_tokens=6)])
    h.step([ev.AdmissionsHeld(held=True, running=True), request(1, 40, max_tokens=3)])
    for _ in range(3):
        result = h.step()
        assert result.plan.is_empty and not of_type(result.decisions, ev.DecodeScheduled)
    assert not h.engine.has_work  # (so a paused engine idles, not spins)
    result = h.step([ev.AdmissionsHeld(held=False)])
    assert of_type(result.decisions, ev.DecodeScheduled) and admitted(result) == [1]
    h.run_until_idle()
    assert h.state.stats.requests_finished == 2


def test_holding_what_runs_too_round_trips_through_the_log_codec_and_lifts_with_the_hold():
    event = ev.AdmissionsHeld(held=True, running=True)
    assert decode_events(encode([event])) == [event]
    h = Harness()
    h.step([event])
    assert h.state.serving.running_held and h.state.serving.admissions_held
    h.step([ev.AdmissionsHeld(held=True)])  # back to PAUSED_NEW: what runs goes on
    assert h.state.serving.admissions_held and not h.state.serving.running_held


def test_a_drain_goes_ahead_while_everything_is_held():
    h = Harness()
    h.step([request(0, 40, max_tokens=8)])
    h.step([ev.AdmissionsHeld(held=True, running=True)])
    result = h.step([ev.DrainRequested()])
    assert of_type(result.decisions, ev.Drained) and h.state.sleeping
