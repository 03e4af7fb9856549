"""The declared map of which event fires which trigger: checked at import, used by every
fold, and it catches a dead declared edge or an event firing a trigger its machine lacks."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.events import types as ev
from kvsched.statemachines import (
    ALL_MACHINES,
    CHECKPOINT,
    EVENT_TRIGGERS,
    KVLOAD,
    KVSAVE,
    SEQUENCE,
    CkptEvent,
    IllegalTransition,
    LoadEvent,
    MachineDefinitionError,
    SaveEvent,
    SeqEvent,
    SeqState,
    check_triggers,
    fire,
    fire_many,
)
from kvsched.statemachines import triggers as triggers_module
from kvsched.statemachines.triggers import trigger_for


def test_every_trigger_of_every_machine_is_fired_by_some_event():
    for machine in ALL_MACHINES:
        fired = {t for per in EVENT_TRIGGERS.values() for t in per.get(machine, ())}
        assert fired == set(machine.spec.events), machine.name


def test_every_trigger_an_event_fires_is_used_by_a_transition_of_its_machine():
    for per_machine in EVENT_TRIGGERS.values():
        for machine, triggers in per_machine.items():
            used = {t.event for t in machine.spec.transitions}
            assert set(triggers) <= used


def test_every_event_in_the_map_is_an_input_or_a_decision():
    assert set(EVENT_TRIGGERS) <= set(ev.INPUT_TYPES) | set(ev.DECISION_TYPES)


def test_a_declared_trigger_no_event_fires_is_refused(monkeypatch: pytest.MonkeyPatch):
    mapping = {k: dict(v) for k, v in EVENT_TRIGGERS.items()}
    del mapping[ev.CheckpointReleased]
    monkeypatch.setattr(triggers_module, "EVENT_TRIGGERS", mapping)
    with pytest.raises(MachineDefinitionError, match=r"Checkpoint\.release"):
        check_triggers()


def test_an_event_firing_a_trigger_of_another_machine_is_refused(monkeypatch: pytest.MonkeyPatch):
    mapping = {k: dict(v) for k, v in EVENT_TRIGGERS.items()}
    mapping[ev.SequenceAdmitted] = {SEQUENCE: (SeqEvent.admit,), CHECKPOINT: (SeqEvent.admit,)}
    monkeypatch.setattr(triggers_module, "EVENT_TRIGGERS", mapping)
    with pytest.raises(MachineDefinitionError, match="SequenceAdmitted"):
        check_triggers()


def test_a_fold_cannot_fire_a_machine_its_event_does_not_declare():
    admitted = ev.SequenceAdmitted(1, 0)
    assert fire(SEQUENCE, admitted, 1, SeqState.WAITING) == SeqState.RUNNING
    with pytest.raises(MachineDefinitionError, match="does not fire a trigger of Checkpoint"):
        fire(CHECKPOINT, admitted, 1, 0)


def test_the_table_chooses_the_trigger_an_event_fires():
    assert trigger_for(SEQUENCE, ev.SequenceAdmitted(1, 0)) is SeqEvent.admit
    finished = ev.KVSaveFinished(3, ok=False)
    assert trigger_for(KVSAVE, finished) is SaveEvent.fail
    assert trigger_for(KVSAVE, ev.KVSaveFinished(3, ok=True)) is SaveEvent.confirm
    # A lookup answer past the blocks the engine has is a hit, else a miss (the context).
    assert trigger_for(KVLOAD, ev.KVLookupAnswered(0, 5), 2) is LoadEvent.lookup_hit
    assert trigger_for(KVLOAD, ev.KVLookupAnswered(0, 2), 2) is LoadEvent.lookup_miss


def test_an_event_naming_several_triggers_without_a_selector_is_refused(
    monkeypatch: pytest.MonkeyPatch,
):
    mapping = {k: dict(v) for k, v in EVENT_TRIGGERS.items()}
    mapping[ev.KVSaveFinished] = {
        KVSAVE: (SaveEvent.confirm, SaveEvent.fail), CHECKPOINT: (CkptEvent.unpin,)
    }
    monkeypatch.setattr(triggers_module, "EVENT_TRIGGERS", mapping)
    with pytest.raises(MachineDefinitionError, match="no selector"):
        check_triggers()


def test_scheduling_a_row_whose_kv_is_still_loading_is_an_illegal_transition():
    decode = ev.DecodeScheduled(np.array([4, 5]))
    states = np.array([SeqState.RUNNING, SeqState.LOADING_KV])
    with pytest.raises(IllegalTransition, match="Sequence 5: event 'decode' is illegal"):
        fire_many(SEQUENCE, decode, np.array([4, 5]), states)
    ok = fire_many(SEQUENCE, decode, np.array([4]), states[:1])
    assert ok.tolist() == [SeqState.RUNNING]
