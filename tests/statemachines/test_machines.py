"""The declared machines: agreement with `transitions`, and their key behaviours."""

from __future__ import annotations

from collections.abc import Iterator
from enum import IntEnum
from itertools import chain, combinations
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transitions import MachineError

from kvsched.statemachines import (
    ALL_MACHINES,
    ALL_SPECS,
    CHECKPOINT,
    KVLOAD,
    KVSAVE,
    SEQUENCE,
    AmbiguousTransition,
    CkptEvent,
    CkptState,
    CompiledMachine,
    IllegalTransition,
    LoadEvent,
    LoadState,
    MachineSpec,
    SaveEvent,
    SaveState,
    SeqEvent,
    SeqState,
    build_machine,
)

MACHINES = {m.name: m for m in ALL_MACHINES}
AMBIGUOUS = "ambiguous"


def _fact_sets(spec: MachineSpec) -> Iterator[frozenset[str]]:
    guards = sorted({t.guard for t in spec.transitions if t.guard is not None})
    subsets = chain.from_iterable(combinations(guards, k) for k in range(len(guards) + 1))
    return (frozenset(s) for s in subsets)


class _Model:
    """Throwaway model: each guard name is a boolean attribute."""

    def __init__(self, guards: set[str], facts: frozenset[str]) -> None:
        for guard in guards:
            setattr(self, guard, guard in facts)


def _reference(spec: MachineSpec, state: IntEnum, event: IntEnum, facts: frozenset[str]) -> Any:
    """Destination name per ``transitions`` (None if illegal)."""
    machine = build_machine(spec)
    model: Any = _Model({t.guard for t in spec.transitions if t.guard}, facts)
    machine.add_model(model, initial=state.name)
    try:
        fired = model.trigger(event.name)
    except MachineError:
        return None
    return model.state if fired else None


def _compiled(m: CompiledMachine, state: IntEnum, event: IntEnum, facts: frozenset[str]) -> Any:
    """Destination name per the compiled machine (None if illegal)."""
    try:
        return m.spec.states(m.next_state(0, state, event, facts)).name
    except AmbiguousTransition:
        return AMBIGUOUS
    except IllegalTransition:
        return None


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_compiled_table_agrees_with_transitions_on_every_state_event_and_fact_set(
    name: str,
) -> None:
    m = MACHINES[name]
    for state in m.spec.states:
        for event in m.spec.events:
            for facts in _fact_sets(m.spec):
                expected, got = (
                    _reference(m.spec, state, event, facts),
                    _compiled(m, state, event, facts),
                )
                where = f"{name} {state.name} --{event.name}--> with facts {sorted(facts)}"
                if got == AMBIGUOUS:
                    assert expected is not None, where
                    assert set(m.guards(state, event)) <= facts, where
                else:
                    assert got == expected, where
                assert m.is_legal(state, event, facts) == (got not in (None, AMBIGUOUS)), where


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_declared_transition_is_accepted_by_both_interpreters(name: str) -> None:
    m = MACHINES[name]
    for t in m.spec.transitions:
        facts = frozenset({t.guard}) if t.guard else frozenset()
        assert m.next_state(1, t.source, t.event, facts) == t.dest
        assert _reference(m.spec, t.source, t.event, facts) == t.dest.name
        if t.guard is None:
            assert m.table[t.event, t.source] == t.dest


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_triggers_of_the_transitions_machine_match_the_compiled_legality(name: str) -> None:
    m = MACHINES[name]
    for state in m.spec.states:
        triggers = set(m.machine.get_triggers(state.name))
        declared = {e.name for e in m.spec.events if m.is_legal(state, e) or m.guards(state, e)}
        assert triggers == declared


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_vectorised_next_states_agrees_with_scalar_next_state(name: str) -> None:
    m = MACHINES[name]
    for event in m.spec.events:
        legal = [s for s in m.spec.states if m.is_legal(s, event) and not m.guards(s, event)]
        states = np.array(legal, dtype=np.int16)
        ids = np.arange(len(legal)) + 100
        got = m.next_states(ids, states, event).tolist()
        assert got == [
            m.next_state(int(i), int(s), event) for i, s in zip(ids, states, strict=True)
        ]


@settings(max_examples=200, deadline=None)
@given(
    machine_index=st.integers(0, len(ALL_MACHINES) - 1),
    raw_states=st.lists(st.integers(0, 7), max_size=20),
    raw_event=st.integers(0, 9),
)
def test_vectorised_and_scalar_agree_on_random_batches(
    machine_index: int, raw_states: list[int], raw_event: int
) -> None:
    m = ALL_MACHINES[machine_index]
    states = [s % len(m.spec.states) for s in raw_states]
    event = raw_event % len(m.spec.events)
    ids = np.arange(len(states), dtype=np.int64) * 7
    scalar: list[int] = []
    first_error: IllegalTransition | None = None
    for entity, state in zip(ids.tolist(), states, strict=True):
        try:
            scalar.append(m.next_state(entity, state, event))
        except IllegalTransition as err:
            first_error = err
            break
    if first_error is None:
        assert m.next_states(ids, np.array(states, dtype=np.int64), event).tolist() == scalar
    else:
        with pytest.raises(IllegalTransition) as info:
            m.next_states(ids, np.array(states, dtype=np.int64), event)
        assert info.value.entity_id == first_error.entity_id
        assert info.value.state == first_error.state


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_terminal_states_reject_every_event_whatever_the_facts(name: str) -> None:
    m = MACHINES[name]
    for state in m.spec.terminal:
        for event in m.spec.events:
            for facts in _fact_sets(m.spec):
                assert not m.is_legal(state, event, facts)


def test_an_illegal_sequence_event_reads_as_a_sentence() -> None:
    with pytest.raises(IllegalTransition) as info:
        SEQUENCE.next_state(17, SeqState.FINISHED, SeqEvent.admit)
    assert str(info.value) == "Sequence 17: event 'admit' is illegal in state FINISHED"
    assert (info.value.machine, info.value.entity_id) == ("Sequence", 17)
    assert (info.value.state, info.value.event) == ("FINISHED", "admit")


def test_a_loading_sequence_leaves_by_settling_or_by_an_abort_or_preemption_only() -> None:
    """(The transfer table refuses the abort and the preemption while the transfer flies:
    tests/reducers/test_transfers.py.)"""
    loading = SeqState.LOADING_KV
    assert SEQUENCE.next_state(3, loading, SeqEvent.load_settled) == SeqState.RUNNING
    assert SEQUENCE.next_state(3, loading, SeqEvent.abort) == SeqState.ABORTED
    assert SEQUENCE.next_state(3, loading, SeqEvent.preempt) == SeqState.WAITING
    for event in (SeqEvent.admit, SeqEvent.begin_load, SeqEvent.finish):
        with pytest.raises(IllegalTransition, match="LOADING_KV"):
            SEQUENCE.next_state(3, loading, event)


def test_a_sequence_abort_is_immediate_outside_a_kv_load() -> None:
    for state in (SeqState.WAITING, SeqState.RUNNING):
        assert SEQUENCE.next_state(1, state, SeqEvent.abort) == SeqState.ABORTED


def test_every_sequence_enters_waiting_and_only_a_running_one_is_scheduled() -> None:
    assert SEQUENCE.spec.initial == (SeqState.WAITING,)
    for state in SeqState:
        for event in (SeqEvent.schedule_chunk, SeqEvent.decode):
            assert SEQUENCE.is_legal(state, event) == (state == SeqState.RUNNING)


def test_a_running_sequence_can_be_chunked_decoded_preempted_or_finished() -> None:
    r = SeqState.RUNNING
    assert SEQUENCE.next_state(1, r, SeqEvent.schedule_chunk) == r
    assert SEQUENCE.next_state(1, r, SeqEvent.decode) == r
    assert SEQUENCE.next_state(1, r, SeqEvent.preempt) == SeqState.WAITING
    assert SEQUENCE.next_state(1, r, SeqEvent.finish) == SeqState.FINISHED


def test_a_kv_load_can_be_cancelled_only_before_the_transfer_starts() -> None:
    before = (LoadState.LOOKUP_PENDING, LoadState.PLANNED, LoadState.ADMITTED, LoadState.ALLOCATED)
    for state in before:
        assert KVLOAD.next_state(1, state, LoadEvent.cancel) == LoadState.CANCELLED
    assert not KVLOAD.is_legal(LoadState.LOADING, LoadEvent.cancel)


def test_a_kv_load_of_the_state_alone_starts_without_an_allocation() -> None:
    assert KVLOAD.next_state(1, LoadState.ADMITTED, LoadEvent.start) == LoadState.LOADING


def test_a_kv_load_walks_from_lookup_to_ready() -> None:
    path = [LoadEvent.lookup_pending, LoadEvent.lookup_hit, LoadEvent.admit]
    path += [LoadEvent.allocate, LoadEvent.start, LoadEvent.finish]
    state: int = LoadState.LOOKUP_PENDING
    for event in path:
        state = KVLOAD.next_state(1, state, event)
    assert state == LoadState.READY


def test_a_kv_save_starts_and_ends_confirmed_or_failed_never_cancelled() -> None:
    assert KVSAVE.next_state(1, SaveState.PENDING, SaveEvent.start) == SaveState.SAVING
    assert KVSAVE.next_state(1, SaveState.SAVING, SaveEvent.confirm) == SaveState.SAVED
    assert KVSAVE.next_state(1, SaveState.SAVING, SaveEvent.fail) == SaveState.FAILED
    assert not any(e.name == "cancel" for e in SaveEvent)


def test_a_pinned_checkpoint_is_never_evicted_or_released() -> None:
    for event in (CkptEvent.evict, CkptEvent.release, CkptEvent.abandon):
        for facts in _fact_sets(CHECKPOINT.spec):
            assert not CHECKPOINT.is_legal(CkptState.PINNED, event, facts)
    assert all(t.source != CkptState.PINNED or t.dest == CkptState.PUBLISHED
               or t.dest == CkptState.PINNED for t in CHECKPOINT.spec.transitions)  # fmt: skip


def test_unpinning_a_checkpoint_depends_on_whether_it_was_the_last_pin() -> None:
    p, unpin = CkptState.PINNED, CkptEvent.unpin
    assert CHECKPOINT.next_state(1, p, unpin, frozenset({"last_pin"})) == CkptState.PUBLISHED
    assert CHECKPOINT.next_state(1, p, unpin, frozenset({"more_pins"})) == CkptState.PINNED
    with pytest.raises(IllegalTransition):
        CHECKPOINT.next_state(1, p, unpin)
    with pytest.raises(AmbiguousTransition):
        CHECKPOINT.next_state(1, p, unpin, frozenset({"last_pin", "more_pins"}))


def test_an_abandoned_reservation_is_released() -> None:
    assert CHECKPOINT.next_state(1, CkptState.RESERVED, CkptEvent.abandon) == CkptState.RELEASED


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_states_are_upper_case_and_events_lower_case_int_enums_from_zero(
    spec: MachineSpec,
) -> None:
    assert [int(s) for s in spec.states] == list(range(len(spec.states)))
    assert [int(e) for e in spec.events] == list(range(len(spec.events)))
    assert all(s.name.isupper() for s in spec.states)
    assert all(e.name.islower() for e in spec.events)


def test_module_level_machines_match_their_specs() -> None:
    assert [m.spec for m in ALL_MACHINES] == list(ALL_SPECS)
    assert [m.name for m in ALL_MACHINES] == [
        "Sequence", "KVLoad", "KVSave", "Checkpoint", "PrefillTurn"
    ]
