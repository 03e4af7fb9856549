"""Declarative core: machine specs, validation, and compilation to lookup tables.

A lifecycle is declared once as a :class:`MachineSpec`. :func:`compile_spec`
validates it, loads it into a ``transitions.Machine`` (the reference
interpreter, used for cross-checking and diagrams) and compiles it into a
:class:`CompiledMachine` whose hot-path lookups are plain dict / numpy reads.
"""

from __future__ import annotations

import keyword
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final, NoReturn

import numpy as np
import numpy.typing as npt
from transitions import Machine

__all__ = [
    "NO_FACTS",
    "AmbiguousTransition",
    "CompiledMachine",
    "IllegalTransition",
    "MachineDefinitionError",
    "MachineSpec",
    "Transition",
    "build_machine",
    "compile_spec",
    "validate_spec",
]

NO_FACTS: Final[frozenset[str]] = frozenset()
ILLEGAL: Final[int] = -1

IntArray = npt.NDArray[np.integer[Any]]


class MachineDefinitionError(ValueError):
    """A :class:`MachineSpec` violates a structural rule."""


class IllegalTransition(Exception):
    """An event was applied to an entity in a state that does not accept it."""

    machine: str
    entity_id: int
    state: str
    event: str
    guards: tuple[str, ...]

    def __init__(
        self, machine: str, entity_id: int, state: str, event: str, guards: tuple[str, ...] = ()
    ) -> None:
        super().__init__(machine, entity_id, state, event, guards)
        self.machine = machine
        self.entity_id = entity_id
        self.state = state
        self.event = event
        self.guards = guards

    def __str__(self) -> str:
        where = f"{self.machine} {self.entity_id}"
        msg = f"{where}: event '{self.event}' is illegal in state {self.state}"
        if self.guards:
            needed = " or ".join(repr(g) for g in self.guards)
            msg += f" unless fact {needed} holds"
        return msg


class AmbiguousTransition(IllegalTransition):
    """More than one guard of a (state, event) pair holds at once."""

    def __str__(self) -> str:
        held = " and ".join(repr(g) for g in self.guards)
        return (
            f"{self.machine} {self.entity_id}: event '{self.event}' is ambiguous in state "
            f"{self.state}: facts {held} hold at once"
        )


@dataclass(frozen=True, slots=True)
class Transition:
    """One edge: ``source --event--> dest``, optionally only when fact ``guard`` holds."""

    event: IntEnum
    source: IntEnum
    dest: IntEnum
    guard: str | None = None


@dataclass(frozen=True)
class MachineSpec:
    """A lifecycle declared as data. Validated by :func:`validate_spec`."""

    name: str
    states: type[IntEnum]
    events: type[IntEnum]
    initial: tuple[IntEnum, ...]
    terminal: tuple[IntEnum, ...]
    transitions: tuple[Transition, ...]
    description: str = ""

    def exits(self, state: IntEnum) -> tuple[Transition, ...]:
        """Transitions leaving ``state`` (in declaration order)."""
        return tuple(t for t in self.transitions if t.source == state)


# --------------------------------------------------------------------------- validation


def validate_spec(spec: MachineSpec) -> None:
    """Raise :class:`MachineDefinitionError` if ``spec`` breaks any structural rule."""
    _check_enum(spec, spec.states, "state")
    _check_enum(spec, spec.events, "event")
    _check_members(spec)
    _check_determinism(spec)
    _check_exits(spec)
    _check_reachable(spec)


def _fail(spec: MachineSpec, message: str) -> MachineDefinitionError:
    return MachineDefinitionError(f"machine {spec.name!r}: {message}")


def _check_enum(spec: MachineSpec, enum_type: type[IntEnum], kind: str) -> None:
    if not (isinstance(enum_type, type) and issubclass(enum_type, IntEnum)):
        raise _fail(spec, f"{kind}s must be an IntEnum, got {enum_type!r}")
    values = [int(m) for m in enum_type]
    if values != list(range(len(values))) or not values:
        raise _fail(spec, f"{kind} enum {enum_type.__name__} must have values 0..n-1, got {values}")


def _check_members(spec: MachineSpec) -> None:
    if not spec.initial:
        raise _fail(spec, "at least one initial state is required")
    for role, members in (("initial", spec.initial), ("terminal", spec.terminal)):
        for s in members:
            _require_member(spec, s, spec.states, f"{role} state")
    for t in spec.transitions:
        _require_member(spec, t.event, spec.events, "transition event")
        _require_member(spec, t.source, spec.states, "transition source")
        _require_member(spec, t.dest, spec.states, "transition dest")
        if t.guard is not None and not (t.guard.isidentifier() and not keyword.iskeyword(t.guard)):
            raise _fail(spec, f"guard {t.guard!r} on {_edge(t)} is not a valid identifier")


def _require_member(spec: MachineSpec, value: object, enum_type: type[IntEnum], role: str) -> None:
    if not isinstance(value, enum_type):
        raise _fail(spec, f"{role} {value!r} is not a member of {enum_type.__name__}")


def _check_determinism(spec: MachineSpec) -> None:
    groups: defaultdict[tuple[IntEnum, IntEnum], list[Transition]] = defaultdict(list)
    for t in spec.transitions:
        groups[(t.source, t.event)].append(t)
    for (source, event), group in groups.items():
        where = f"state {source.name} on event '{event.name}'"
        guards = [t.guard for t in group if t.guard is not None]
        unguarded = len(group) - len(guards)
        if unguarded > 1:
            raise _fail(
                spec, f"{where} has {unguarded} unguarded transitions (at most one allowed)"
            )
        if unguarded and guards:
            raise _fail(spec, f"{where} mixes an unguarded transition with guarded ones {guards}")
        if len(set(guards)) != len(guards):
            raise _fail(spec, f"{where} has guarded alternatives with duplicate guards {guards}")


def _check_exits(spec: MachineSpec) -> None:
    terminal = set(spec.terminal)
    for state in spec.states:
        exits = spec.exits(state)
        if state in terminal and exits:
            raise _fail(spec, f"terminal state {state.name} has exits: {_edges(exits)}")
        if state not in terminal and not exits:
            raise _fail(spec, f"non-terminal state {state.name} has no exits")


def _check_reachable(spec: MachineSpec) -> None:
    seen = _reachable(spec.initial, spec.transitions)
    missing = [s.name for s in spec.states if s not in seen]
    if missing:
        start = ", ".join(s.name for s in spec.initial)
        raise _fail(spec, f"states {missing} are not reachable from initial state(s) {start}")


def _reachable(initial: Iterable[IntEnum], transitions: Iterable[Transition]) -> set[IntEnum]:
    adjacency: defaultdict[IntEnum, list[IntEnum]] = defaultdict(list)
    for t in transitions:
        adjacency[t.source].append(t.dest)
    seen = set(initial)
    queue = deque(seen)
    while queue:
        for nxt in adjacency[queue.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def _edge(t: Transition) -> str:
    guard = f" [{t.guard}]" if t.guard else ""
    return f"{t.source.name} -{t.event.name}{guard}-> {t.dest.name}"


def _edges(ts: Iterable[Transition]) -> str:
    return ", ".join(_edge(t) for t in ts)


# --------------------------------------------------------------------------- transitions.Machine


def build_machine(spec: MachineSpec, model: object | None = None) -> Any:
    """Load ``spec`` into a fresh ``transitions.Machine`` (no model unless given).

    Guards become condition names, resolved as attributes of the model.
    """
    return Machine(
        model=[] if model is None else model,
        states=[s.name for s in spec.states],
        initial=spec.initial[0].name,
        transitions=[_transition_kwargs(t) for t in spec.transitions],
        auto_transitions=False,
        name=spec.name,
    )


def _transition_kwargs(t: Transition) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trigger": t.event.name, "source": t.source.name, "dest": t.dest.name}
    if t.guard is not None:
        kwargs["conditions"] = [t.guard]
    return kwargs


def _check_machine_agrees(spec: MachineSpec, machine: Any) -> None:
    for state in spec.states:
        loaded = set(machine.get_triggers(state.name))
        declared = {t.event.name for t in spec.exits(state)}
        if loaded != declared:
            raise _fail(spec, f"transitions.Machine triggers {loaded} != declared {declared}")


# --------------------------------------------------------------------------- compilation


def compile_spec(spec: MachineSpec) -> CompiledMachine:
    """Validate ``spec``, load it into ``transitions`` and compile the lookup tables."""
    validate_spec(spec)
    machine = build_machine(spec)
    _check_machine_agrees(spec, machine)
    return CompiledMachine(spec, machine)


class CompiledMachine:
    """Hot-path view of a validated spec: dict lookups and a numpy [event, state] table."""

    __slots__ = ("_fast", "_guarded", "machine", "name", "spec", "table")

    spec: MachineSpec
    name: str
    machine: Any
    table: npt.NDArray[np.int64]
    _fast: dict[tuple[int, int], IntEnum]
    _guarded: dict[tuple[int, int], tuple[tuple[str, IntEnum], ...]]

    def __init__(self, spec: MachineSpec, machine: Any) -> None:
        """Build lookups; use :func:`compile_spec`, which validates first."""
        self.spec = spec
        self.name = spec.name
        self.machine = machine
        self._fast = {
            (int(t.source), int(t.event)): t.dest for t in spec.transitions if t.guard is None
        }
        self._guarded = _guarded_lookup(spec.transitions)
        self.table = _unguarded_table(spec, self._fast)

    def __repr__(self) -> str:
        return f"CompiledMachine({self.name!r})"

    def next_state(
        self, entity_id: int, state: int, event: int, facts: frozenset[str] = NO_FACTS
    ) -> int:
        """Destination of ``event`` in ``state``; guarded edges need their guard in ``facts``."""
        try:
            return self._fast[(state, event)]
        except KeyError:
            return self._next_guarded(entity_id, state, event, facts)

    def is_legal(self, state: int, event: int, facts: frozenset[str] = NO_FACTS) -> bool:
        """Whether :meth:`next_state` would accept ``event`` in ``state`` given ``facts``."""
        if (state, event) in self._fast:
            return True
        options = self._guarded.get((state, event), ())
        return sum(guard in facts for guard, _ in options) == 1

    def guards(self, state: int, event: int) -> tuple[str, ...]:
        """Guard names of the guarded alternatives for (state, event); empty if none."""
        return tuple(guard for guard, _ in self._guarded.get((state, event), ()))

    def next_states(
        self, entity_ids: IntArray, states: IntArray, event: int
    ) -> npt.NDArray[np.int64]:
        """Vectorised :meth:`next_state` for unguarded transitions (guarded ones are illegal)."""
        ids, states = np.asarray(entity_ids), np.asarray(states)
        if ids.shape != states.shape or states.ndim != 1:
            raise ValueError(f"entity_ids {ids.shape} and states {states.shape} must be equal 1-D")
        if not states.size:
            return np.empty(0, dtype=np.int64)
        if not np.issubdtype(states.dtype, np.integer):
            raise TypeError(f"states must be an integer array, got dtype {states.dtype}")
        n_events, n_states = self.table.shape
        if not 0 <= event < n_events or states.min() < 0 or states.max() >= n_states:
            return self._raise_first_illegal(ids, states, event)
        dests: npt.NDArray[np.int64] = self.table[event][states]
        if dests.min() == ILLEGAL:
            return self._raise_first_illegal(ids, states, event)
        return dests

    def _raise_first_illegal(self, ids: IntArray, states: IntArray, event: int) -> NoReturn:
        n_events, n_states = self.table.shape
        for entity, state in zip(ids.tolist(), states.tolist(), strict=True):
            if not (0 <= event < n_events and 0 <= state < n_states):
                raise self._illegal(int(entity), int(state), event)
            if self.table[event, state] == ILLEGAL:
                raise self._illegal(int(entity), int(state), event)
        raise AssertionError("no illegal entry found")  # pragma: no cover

    def _next_guarded(self, entity_id: int, state: int, event: int, facts: frozenset[str]) -> int:
        options = self._guarded.get((state, event), ())
        matches = [(guard, dest) for guard, dest in options if guard in facts]
        if len(matches) == 1:
            return matches[0][1]
        if matches:
            held = tuple(guard for guard, _ in matches)
            raise AmbiguousTransition(self.name, entity_id, *self._names(state, event), held)
        raise self._illegal(entity_id, state, event)

    def _illegal(self, entity_id: int, state: int, event: int) -> IllegalTransition:
        guards = self.guards(state, event)
        return IllegalTransition(self.name, entity_id, *self._names(state, event), guards)

    def _names(self, state: int, event: int) -> tuple[str, str]:
        return _member_name(self.spec.states, state), _member_name(self.spec.events, event)


def _member_name(enum_type: type[IntEnum], value: int) -> str:
    try:
        return enum_type(value).name
    except (ValueError, TypeError):
        return f"<invalid {enum_type.__name__} {value!r}>"


def _guarded_lookup(
    transitions: Iterable[Transition],
) -> dict[tuple[int, int], tuple[tuple[str, IntEnum], ...]]:
    groups: defaultdict[tuple[int, int], list[tuple[str, IntEnum]]] = defaultdict(list)
    for t in transitions:
        if t.guard is not None:
            groups[(int(t.source), int(t.event))].append((t.guard, t.dest))
    return {key: tuple(options) for key, options in groups.items()}


def _unguarded_table(
    spec: MachineSpec, fast: dict[tuple[int, int], IntEnum]
) -> npt.NDArray[np.int64]:
    table = np.full((len(spec.events), len(spec.states)), ILLEGAL, dtype=np.int64)
    for (state, event), dest in fast.items():
        table[event, state] = int(dest)
    table.flags.writeable = False
    return table
