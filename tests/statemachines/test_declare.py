"""Behaviour of the declarative core on a small toy machine."""

from __future__ import annotations

import pickle
from dataclasses import replace
from enum import IntEnum

import numpy as np
import pytest

from kvsched.statemachines import (
    AmbiguousTransition,
    IllegalTransition,
    MachineDefinitionError,
    MachineSpec,
    Transition,
    build_machine,
    compile_spec,
    validate_spec,
)


class S(IntEnum):
    A = 0
    B = 1
    C = 2
    DONE = 3


class E(IntEnum):
    go = 0
    back = 1
    end = 2
    skip = 3


A_GO_B = Transition(E.go, S.A, S.B)
A_SKIP_C = Transition(E.skip, S.A, S.C)
C_GO_DONE = Transition(E.go, S.C, S.DONE)

TOY = MachineSpec(
    name="Toy",
    states=S,
    events=E,
    initial=(S.A,),
    terminal=(S.DONE,),
    transitions=(
        A_GO_B,
        Transition(E.back, S.B, S.A),
        Transition(E.end, S.B, S.DONE, "ok"),
        Transition(E.end, S.B, S.A, "retry"),
        A_SKIP_C,
        C_GO_DONE,
    ),
)


def _without(spec: MachineSpec, *drop: Transition) -> MachineSpec:
    return replace(spec, transitions=tuple(t for t in spec.transitions if t not in drop))


def _with(spec: MachineSpec, *extra: Transition) -> MachineSpec:
    return replace(spec, transitions=(*spec.transitions, *extra))


class NotContiguous(IntEnum):
    X = 1
    Y = 2


BROKEN_SPECS: dict[str, tuple[MachineSpec, str]] = {
    "unreachable state": (_without(TOY, A_SKIP_C), "not reachable"),
    "terminal state with an exit": (
        _with(TOY, Transition(E.back, S.DONE, S.A)),
        "terminal state DONE has exits",
    ),
    "non-terminal state without exits": (
        _without(TOY, C_GO_DONE),
        "non-terminal state C has no exits",
    ),
    "two unguarded transitions": (_with(TOY, Transition(E.go, S.A, S.C)), "2 unguarded"),
    "duplicate guard names": (_with(TOY, Transition(E.end, S.B, S.C, "ok")), "duplicate guards"),
    "unguarded mixed with guarded": (_with(TOY, Transition(E.end, S.B, S.C)), "mixes an unguarded"),
    "no initial state": (replace(TOY, initial=()), "at least one initial state"),
    "state from the wrong enum": (_with(TOY, Transition(E.go, E.go, S.A)), "not a member of S"),
    "guard that is not an identifier": (
        _with(TOY, Transition(E.back, S.C, S.A, "not ok")),
        "not a valid identifier",
    ),
    "enum values not 0..n-1": (replace(TOY, states=NotContiguous), "must have values 0..n-1"),
}


def test_the_toy_spec_is_valid_and_compiles() -> None:
    validate_spec(TOY)
    assert compile_spec(TOY).name == "Toy"


@pytest.mark.parametrize("case", sorted(BROKEN_SPECS))
def test_each_validation_rule_rejects_a_broken_spec(case: str) -> None:
    spec, fragment = BROKEN_SPECS[case]
    with pytest.raises(MachineDefinitionError, match=fragment) as info:
        validate_spec(spec)
    assert "'Toy'" in str(info.value)


@pytest.mark.parametrize("case", sorted(BROKEN_SPECS))
def test_compiling_a_broken_spec_fails_before_anything_is_built(case: str) -> None:
    with pytest.raises(MachineDefinitionError):
        compile_spec(BROKEN_SPECS[case][0])


def test_an_unreachable_state_is_named_in_the_error() -> None:
    with pytest.raises(MachineDefinitionError, match=r"\['C'\].*initial state\(s\) A"):
        validate_spec(_without(TOY, A_SKIP_C))


def test_a_state_reachable_only_from_a_second_initial_state_is_accepted() -> None:
    validate_spec(replace(_without(TOY, A_SKIP_C), initial=(S.A, S.C)))


def test_an_unguarded_transition_returns_its_destination() -> None:
    toy = compile_spec(TOY)
    assert toy.next_state(1, S.A, E.go) == S.B
    assert toy.next_state(1, int(S.A), int(E.go)) == S.B
    assert toy.is_legal(S.A, E.go)


def test_an_illegal_transition_names_the_entity_state_and_event() -> None:
    toy = compile_spec(TOY)
    with pytest.raises(IllegalTransition) as info:
        toy.next_state(17, S.DONE, E.go)
    err = info.value
    assert (err.machine, err.entity_id, err.state, err.event) == ("Toy", 17, "DONE", "go")
    assert str(err) == "Toy 17: event 'go' is illegal in state DONE"
    assert not toy.is_legal(S.DONE, E.go)


def test_a_guarded_transition_needs_its_guard_fact() -> None:
    toy = compile_spec(TOY)
    with pytest.raises(IllegalTransition, match="unless fact 'ok' or 'retry' holds") as info:
        toy.next_state(5, S.B, E.end)
    assert info.value.guards == ("ok", "retry")
    assert toy.next_state(5, S.B, E.end, frozenset({"ok"})) == S.DONE
    assert toy.next_state(5, S.B, E.end, frozenset({"retry", "unrelated"})) == S.A
    assert toy.is_legal(S.B, E.end, frozenset({"ok"}))
    assert not toy.is_legal(S.B, E.end)
    assert toy.guards(S.B, E.end) == ("ok", "retry")


def test_facts_are_ignored_by_unguarded_transitions() -> None:
    assert compile_spec(TOY).next_state(1, S.A, E.go, frozenset({"ok"})) == S.B


def test_two_guards_holding_at_once_is_an_ambiguous_transition() -> None:
    toy = compile_spec(TOY)
    with pytest.raises(AmbiguousTransition, match="ambiguous in state B") as info:
        toy.next_state(9, S.B, E.end, frozenset({"ok", "retry"}))
    assert isinstance(info.value, IllegalTransition)
    assert info.value.guards == ("ok", "retry")
    assert not toy.is_legal(S.B, E.end, frozenset({"ok", "retry"}))


def test_an_out_of_range_state_or_event_is_illegal_not_a_crash() -> None:
    toy = compile_spec(TOY)
    with pytest.raises(IllegalTransition, match="<invalid S 99>"):
        toy.next_state(1, 99, E.go)
    with pytest.raises(IllegalTransition, match="<invalid E 42>"):
        toy.next_state(1, S.A, 42)


def test_illegal_transition_survives_pickling() -> None:
    err = IllegalTransition("Toy", 3, "B", "end", ("ok",))
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.machine, copy.entity_id, copy.state, copy.event, copy.guards) == (
        "Toy",
        3,
        "B",
        "end",
        ("ok",),
    )
    assert str(copy) == str(err)


def test_the_vectorised_table_holds_unguarded_destinations_and_minus_one_elsewhere() -> None:
    toy = compile_spec(TOY)
    assert toy.table.shape == (len(E), len(S))
    assert toy.table[E.go, S.A] == S.B
    assert toy.table[E.end, S.B] == -1  # guarded: scalar path only
    assert not toy.table.flags.writeable


def test_next_states_maps_a_batch_in_one_call() -> None:
    toy = compile_spec(TOY)
    out = toy.next_states(np.array([10, 11]), np.array([S.A, S.C], dtype=np.int8), E.go)
    assert out.tolist() == [S.B, S.DONE]


def test_next_states_names_the_first_offending_entity() -> None:
    toy = compile_spec(TOY)
    ids, states = np.array([10, 11, 12, 13]), np.array([S.A, S.A, S.DONE, S.B])
    with pytest.raises(IllegalTransition) as info:
        toy.next_states(ids, states, E.go)
    assert (info.value.entity_id, info.value.state, info.value.event) == (12, "DONE", "go")


def test_next_states_rejects_out_of_range_states_and_events() -> None:
    toy = compile_spec(TOY)
    with pytest.raises(IllegalTransition) as info:
        toy.next_states(np.array([1, 2]), np.array([0, -1]), E.go)
    assert info.value.entity_id == 2
    with pytest.raises(IllegalTransition, match="<invalid E 7>"):
        toy.next_states(np.array([1]), np.array([0]), 7)


def test_next_states_accepts_an_empty_batch() -> None:
    toy = compile_spec(TOY)
    empty = np.array([], dtype=np.int64)
    assert toy.next_states(empty, empty, E.go).shape == (0,)
    assert toy.next_states(empty, empty, 99).shape == (0,)


def test_next_states_rejects_mismatched_shapes_and_non_integer_states() -> None:
    toy = compile_spec(TOY)
    with pytest.raises(ValueError, match="must be equal 1-D"):
        toy.next_states(np.array([1, 2]), np.array([0]), E.go)
    with pytest.raises(TypeError, match="integer array"):
        toy.next_states(np.array([1]), np.array([0.0]), E.go)


def test_the_transitions_machine_has_no_auto_transitions_and_uses_names() -> None:
    machine = build_machine(TOY)
    assert set(machine.states) == {s.name for s in S}
    assert set(machine.events) == {e.name for e in E}
    assert sorted(machine.get_triggers("A")) == ["go", "skip"]
