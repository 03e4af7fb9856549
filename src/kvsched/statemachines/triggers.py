"""Which domain event fires which machine trigger: declared as data, checked at import.

``EVENT_TRIGGERS[EventType]`` names, per machine, the trigger that folding one event of that
type fires on the entity it concerns: one trigger, or a ``Choice`` of several with the
selector that picks one from the event's content (a lookup answer is a hit, a miss or still
pending; a save's answer confirms or fails it; a prefill turn's name says which turn it
enters). The guard of ``unpin`` then selects its edge from the facts the fold gives. Folds
never name a trigger of their own: they ask ``fire`` / ``fire_many`` with the event, which
take the trigger from this table, so every lifecycle change is traceable to an event type
in one table.

Checked when this module is imported (``check_triggers``):

* every trigger of every machine is fired by some event (no dead declared edge);
* every trigger an event fires is an event of that machine used by one of its transitions.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import Any, NoReturn, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvsched.events import types as ev
from kvsched.statemachines.declare import (
    ILLEGAL,
    NO_FACTS,
    CompiledMachine,
    MachineDefinitionError,
)
from kvsched.statemachines.machines import (
    ALL_MACHINES,
    CHECKPOINT,
    KVLOAD,
    KVSAVE,
    PREFILL_TURN,
    SEQUENCE,
    CkptEvent,
    LoadEvent,
    SaveEvent,
    SeqEvent,
    TurnEvent,
    TurnState,
)

__all__ = [
    "ENTERED_BY", "EVENT_TRIGGERS", "Choice", "check_triggers", "fire", "fire_many",
    "trigger_for", "triggers_of",
]

_S, _L, _V, _C, _T = SeqEvent, LoadEvent, SaveEvent, CkptEvent, TurnEvent

# The selector of a Choice: (event, context the fold gives) -> the trigger it fires.
Selector = Callable[[Any, Any], IntEnum]


class Choice(tuple[IntEnum, ...]):
    """Several triggers one event type may fire on a machine, and the selector that picks
    one from an event (and the context its fold passes, e.g. a lookup's first block)."""

    select: Selector

    def __new__(cls, select: Selector, *triggers: IntEnum) -> Choice:
        self = super().__new__(cls, triggers)
        self.select = select
        return self


def _lookup_answer(e: ev.KVLookupAnswered, first_block: int) -> IntEnum:
    """Still pending; a hit past the blocks the engine has (``first_block``); else a miss."""
    if e.pending:
        return _L.lookup_pending
    return _L.lookup_hit if e.num_blocks > first_block else _L.lookup_miss


def _save_answer(e: ev.KVSaveFinished, _: object) -> IntEnum:
    return _V.confirm if e.ok else _V.fail


# The trigger that enters each prefill turn (besides a fallback).
ENTERED_BY: dict[TurnState, TurnEvent] = {
    TurnState.STANDARD: _T.no_long_work,
    TurnState.SHORT_ONLY: _T.short_turn,
    TurnState.LONG_FIRST: _T.long_turn,
    TurnState.LONG_FIRST_IF_FINAL: _T.final_long_turn,
}


def _turn_chosen(e: ev.PrefillTurnChosen, dest: TurnState) -> IntEnum:
    """A fallback, or the trigger entering the turn the event names (``dest``, which its
    fold parsed)."""
    return _T.fall_back if e.fallback else ENTERED_BY[dest]


EVENT_TRIGGERS: dict[type[ev.Event], dict[CompiledMachine, tuple[IntEnum, ...]]] = {
    ev.SequenceAdmitted: {SEQUENCE: (_S.admit,)},
    ev.KVLoadAdmitted: {SEQUENCE: (_S.begin_load,), KVLOAD: (_L.admit,)},
    ev.KVLoadSettled: {SEQUENCE: (_S.load_settled,)},
    ev.PrefillScheduled: {SEQUENCE: (_S.schedule_chunk,)},
    ev.DecodeScheduled: {SEQUENCE: (_S.decode,)},
    ev.SequencePreempted: {SEQUENCE: (_S.preempt,)},
    ev.SequenceFinished: {SEQUENCE: (_S.finish,)},
    ev.SequenceAborted: {SEQUENCE: (_S.abort,)},
    ev.KVLookupAnswered: {
        KVLOAD: Choice(_lookup_answer, _L.lookup_hit, _L.lookup_miss, _L.lookup_pending)
    },
    ev.KVLoadCancelled: {KVLOAD: (_L.cancel,)},
    ev.BlocksAllocated: {KVLOAD: (_L.allocate,)},
    ev.KVLoadStarted: {KVLOAD: (_L.start,)},
    ev.KVLoadFinished: {KVLOAD: (_L.finish,)},
    ev.KVLoadFailed: {KVLOAD: (_L.fail,)},
    ev.KVSaveStarted: {KVSAVE: (_V.start,), CHECKPOINT: (_C.pin,)},
    ev.KVSaveFinished: {KVSAVE: Choice(_save_answer, _V.confirm, _V.fail), CHECKPOINT: (_C.unpin,)},
    ev.KVHoldRequested: {KVSAVE: (_V.start,)},  # (a connector's own save: a lease it asked for)
    ev.KVHoldReleased: {KVSAVE: (_V.confirm,)},
    ev.CheckpointPublished: {CHECKPOINT: (_C.publish,)},
    ev.CheckpointAbandoned: {CHECKPOINT: (_C.abandon,)},
    ev.CheckpointPinned: {CHECKPOINT: (_C.pin,)},
    ev.CheckpointUnpinned: {CHECKPOINT: (_C.unpin,)},
    ev.CheckpointEvicted: {CHECKPOINT: (_C.evict,)},
    ev.CheckpointReleased: {CHECKPOINT: (_C.release,)},
    ev.PrefillTurnChosen: {
        PREFILL_TURN: Choice(
            _turn_chosen,
            _T.no_long_work, _T.short_turn, _T.long_turn, _T.final_long_turn, _T.fall_back,
        )
    },
}

_ALLOWED: frozenset[tuple[type[ev.Event], CompiledMachine, IntEnum]] = frozenset(
    (kind, machine, trigger)
    for kind, per_machine in EVENT_TRIGGERS.items()
    for machine, triggers in per_machine.items()
    for trigger in triggers
)

# (event type, machine, trigger, source state) -> destination of every unguarded edge that an
# event may take (``fire`` reads one entry; guarded and illegal edges take the full path).
_EDGES: dict[tuple[type[ev.Event], CompiledMachine, int, int], Any] = {
    (kind, machine, int(t.event), int(t.source)): t.dest
    for kind, machine, trigger in _ALLOWED
    for t in machine.spec.transitions
    if t.guard is None and t.event == trigger
}


# (event type, machine, source state) -> destination, for an event type that fires a single
# trigger on the machine by an unguarded edge (``fire``'s common case: one table read).
_DIRECT: dict[tuple[type[ev.Event], CompiledMachine, int], Any] = {
    (kind, machine, source): dest
    for (kind, machine, trigger, source), dest in _EDGES.items()
    if not isinstance(EVENT_TRIGGERS[kind][machine], Choice)
}


# (event type, machine) -> for an event type that fires a single trigger on the machine: the
# destination of its unguarded edge from each source state, ILLEGAL where it has none
# (``fire_many``'s common case: one array read per entity).
_ROWS: dict[tuple[type[ev.Event], CompiledMachine], npt.NDArray[np.int64]] = {
    (kind, machine): machine.table[int(triggers[0])]
    for kind, per_machine in EVENT_TRIGGERS.items()
    for machine, triggers in per_machine.items()
    if not isinstance(triggers, Choice)
}


def triggers_of(kind: type[ev.Event], machine: CompiledMachine) -> tuple[IntEnum, ...]:
    return EVENT_TRIGGERS.get(kind, {}).get(machine, ())


def _refuse(kind: type[ev.Event], machine: CompiledMachine) -> NoReturn:
    raise MachineDefinitionError(
        f"{kind.__name__} does not fire a trigger of {machine.name} (statemachines/"
        "triggers.py declares which event fires which trigger)"
    )


def trigger_for(machine: CompiledMachine, event: ev.Event, context: object = None) -> IntEnum:
    """The trigger ``event`` fires on ``machine``: the one its type declares, or the one its
    ``Choice`` selects (from the event and the fold's ``context``)."""
    triggers = EVENT_TRIGGERS.get(type(event), {}).get(machine)
    if triggers is None:
        _refuse(type(event), machine)
    if isinstance(triggers, Choice):
        return triggers.select(event, context)
    return triggers[0]


_State = TypeVar("_State", bound=int)


def fire(
    machine: CompiledMachine,
    event: ev.Event,
    entity_id: int,
    state: _State,
    facts: frozenset[str] = NO_FACTS,
    context: object = None,
) -> _State:
    """The destination, for an entity in ``state`` (a member of the machine's state enum,
    and so is the answer), of the trigger ``event`` fires (``trigger_for``); ``facts`` for a
    guarded edge, ``context`` for a selector."""
    dest: _State | None = _DIRECT.get((type(event), machine, state))
    if dest is not None:  # an unguarded edge of the event's one trigger: the common case
        return dest
    trigger = trigger_for(machine, event, context)
    dest = _EDGES.get((type(event), machine, trigger, state))
    if dest is not None:
        return cast(_State, dest)
    return cast(_State, machine.next_state(entity_id, state, trigger, facts))


def fire_many(
    machine: CompiledMachine, event: ev.Event, entity_ids: np.ndarray, states: np.ndarray
) -> np.ndarray:
    """Vectorised ``fire`` for an event type with one unguarded trigger: the destination of
    each entity's state (equal 1-D arrays of ids and of the machine's states). A state the
    trigger does not leave by an unguarded edge, or one outside the machine, takes
    ``CompiledMachine.next_states``, which raises naming the first such entity."""
    row = _ROWS.get((type(event), machine))
    if row is not None and len(states) and states.min() >= 0 and states.max() < len(row):
        dests: np.ndarray = row[states]
        if dests.min() != ILLEGAL:
            return dests
    return machine.next_states(entity_ids, states, int(trigger_for(machine, event)))


def check_triggers() -> None:
    """Raise MachineDefinitionError if the map and the machines disagree."""
    for kind, per_machine in EVENT_TRIGGERS.items():
        for machine, triggers in per_machine.items():
            if len(triggers) != 1 and not isinstance(triggers, Choice):
                raise MachineDefinitionError(
                    f"{kind.__name__} names several triggers of {machine.name} and no selector"
                )
            used = {t.event for t in machine.spec.transitions}
            for trigger in triggers:
                if not isinstance(trigger, machine.spec.events) or trigger not in used:
                    raise MachineDefinitionError(
                        f"{kind.__name__} fires {trigger!r}, which no transition of "
                        f"{machine.name} uses"
                    )
    for machine in ALL_MACHINES:
        fired = {t for pm in EVENT_TRIGGERS.values() for t in pm.get(machine, ())}
        for trigger in machine.spec.events:
            if trigger not in fired:
                raise MachineDefinitionError(
                    f"{machine.name}.{trigger.name} is declared but no event fires it"
                )


check_triggers()
