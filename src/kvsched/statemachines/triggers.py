"""Which domain event fires which machine trigger: declared as data, checked at import.

``EVENT_TRIGGERS[EventType]`` lists, per machine, the triggers that folding one event of that
type may fire on the entity it concerns (several when the event's content selects one: a
lookup answer is a hit, a miss or still pending; the guard of ``unpin`` selects its edge).
Folds never name a trigger of their own: they ask ``fire`` / ``fire_many``, which look the
trigger up here, so every lifecycle change is traceable to an event type in one table.

Checked when this module is imported (``check_triggers``):

* every trigger of every machine is fired by some event (no dead declared edge);
* every trigger an event fires is an event of that machine used by one of its transitions.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NoReturn, TypeVar, cast

import numpy as np

from kvsched.events import types as ev
from kvsched.statemachines.declare import NO_FACTS, CompiledMachine, MachineDefinitionError
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
)

__all__ = ["EVENT_TRIGGERS", "check_triggers", "fire", "fire_many", "triggers_of"]

_S, _L, _V, _C, _T = SeqEvent, LoadEvent, SaveEvent, CkptEvent, TurnEvent

EVENT_TRIGGERS: dict[type[ev.Event], dict[CompiledMachine, tuple[IntEnum, ...]]] = {
    ev.SequenceAdmitted: {SEQUENCE: (_S.admit,)},
    ev.KVLoadAdmitted: {SEQUENCE: (_S.begin_load,), KVLOAD: (_L.admit,)},
    ev.KVLoadSettled: {SEQUENCE: (_S.load_settled,)},
    ev.PrefillScheduled: {SEQUENCE: (_S.schedule_chunk,)},
    ev.DecodeScheduled: {SEQUENCE: (_S.decode,)},
    ev.SequencePreempted: {SEQUENCE: (_S.preempt,)},
    ev.SequenceFinished: {SEQUENCE: (_S.finish,)},
    ev.SequenceAborted: {SEQUENCE: (_S.abort,)},
    ev.KVLookupAnswered: {KVLOAD: (_L.lookup_hit, _L.lookup_miss, _L.lookup_pending)},
    ev.KVLoadCancelled: {KVLOAD: (_L.cancel,)},
    ev.BlocksAllocated: {KVLOAD: (_L.allocate,)},
    ev.KVLoadStarted: {KVLOAD: (_L.start,)},
    ev.KVLoadFinished: {KVLOAD: (_L.finish,)},
    ev.KVLoadFailed: {KVLOAD: (_L.fail,)},
    ev.KVSaveStarted: {KVSAVE: (_V.start,), CHECKPOINT: (_C.pin,)},
    ev.KVSaveFinished: {KVSAVE: (_V.confirm, _V.fail), CHECKPOINT: (_C.unpin,)},
    ev.CheckpointPublished: {CHECKPOINT: (_C.publish,)},
    ev.CheckpointAbandoned: {CHECKPOINT: (_C.abandon,)},
    ev.CheckpointPinned: {CHECKPOINT: (_C.pin,)},
    ev.CheckpointUnpinned: {CHECKPOINT: (_C.unpin,)},
    ev.CheckpointEvicted: {CHECKPOINT: (_C.evict,)},
    ev.CheckpointReleased: {CHECKPOINT: (_C.release,)},
    ev.PrefillTurnChosen: {
        PREFILL_TURN: (
            _T.no_long_work, _T.short_turn, _T.long_turn, _T.final_long_turn, _T.fall_back
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


def triggers_of(kind: type[ev.Event], machine: CompiledMachine) -> tuple[IntEnum, ...]:
    return EVENT_TRIGGERS.get(kind, {}).get(machine, ())


def _refuse(kind: type[ev.Event], machine: CompiledMachine, trigger: IntEnum) -> NoReturn:
    raise MachineDefinitionError(
            f"{kind.__name__} does not fire {machine.name}.{trigger.name} (statemachines/"
            "triggers.py declares which event fires which trigger)"
        )


_State = TypeVar("_State", bound=int)


def fire(
    machine: CompiledMachine,
    event: ev.Event,
    entity_id: int,
    state: _State,
    trigger: IntEnum,
    facts: frozenset[str] = NO_FACTS,
) -> _State:
    """The destination of ``trigger`` for an entity in ``state`` (a member of the machine's
    state enum, and so is the answer), fired by ``event``."""
    dest: _State | None = _EDGES.get((type(event), machine, trigger, state))
    if dest is not None:  # an unguarded edge this event may take: the common case
        return dest
    if (type(event), machine, trigger) not in _ALLOWED:
        _refuse(type(event), machine, trigger)
    return cast(_State, machine.next_state(entity_id, state, trigger, facts))


def fire_many(
    machine: CompiledMachine,
    event: ev.Event,
    entity_ids: np.ndarray,
    states: np.ndarray,
    trigger: IntEnum,
) -> np.ndarray:
    """Vectorised ``fire`` for unguarded triggers (one table read per entity)."""
    if (type(event), machine, trigger) not in _ALLOWED:
        _refuse(type(event), machine, trigger)
    return machine.next_states(entity_ids, states, int(trigger))


def check_triggers() -> None:
    """Raise MachineDefinitionError if the map and the machines disagree."""
    for kind, per_machine in EVENT_TRIGGERS.items():
        for machine, triggers in per_machine.items():
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
