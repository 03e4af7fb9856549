"""The lifecycle declarations (Sequence, KVLoad, KVSave, Checkpoint) and the engine's prefill
turn (PrefillTurn), compiled at import."""

from __future__ import annotations

from enum import IntEnum

from kvsched.statemachines.declare import CompiledMachine, MachineSpec, Transition, compile_spec

__all__ = [
    "ALL_MACHINES",
    "ALL_SPECS",
    "CHECKPOINT",
    "CHECKPOINT_SPEC",
    "KVLOAD",
    "KVLOAD_SPEC",
    "KVSAVE",
    "KVSAVE_SPEC",
    "PREFILL_TURN",
    "PREFILL_TURN_SPEC",
    "SEQUENCE",
    "SEQUENCE_SPEC",
    "CkptEvent",
    "CkptState",
    "LoadEvent",
    "LoadState",
    "SaveEvent",
    "SaveState",
    "SeqEvent",
    "SeqState",
    "TurnEvent",
    "TurnState",
]

T = Transition


# --------------------------------------------------------------------------- Sequence


class SeqState(IntEnum):
    """Lifecycle states of a request sequence."""

    WAITING = 0
    LOADING_KV = 1
    RUNNING = 2
    FINISHED = 3
    ABORTED = 4


class SeqEvent(IntEnum):
    """Events applied to a sequence."""

    admit = 0
    begin_load = 1
    load_settled = 2
    abort = 3
    schedule_chunk = 4
    decode = 5
    preempt = 6
    finish = 7


_S, _SE = SeqState, SeqEvent

SEQUENCE_SPEC = MachineSpec(
    name="Sequence",
    states=SeqState,
    events=SeqEvent,
    initial=(_S.WAITING,),
    terminal=(_S.FINISHED, _S.ABORTED),
    transitions=(
        T(_SE.admit, _S.WAITING, _S.RUNNING),
        T(_SE.begin_load, _S.WAITING, _S.LOADING_KV),
        T(_SE.load_settled, _S.LOADING_KV, _S.RUNNING),
        T(_SE.schedule_chunk, _S.RUNNING, _S.RUNNING),
        T(_SE.decode, _S.RUNNING, _S.RUNNING),
        T(_SE.preempt, _S.RUNNING, _S.WAITING),
        T(_SE.finish, _S.RUNNING, _S.FINISHED),
        T(_SE.finish, _S.WAITING, _S.FINISHED),
        T(_SE.abort, _S.WAITING, _S.ABORTED),
        T(_SE.abort, _S.RUNNING, _S.ABORTED),
        T(_SE.abort, _S.LOADING_KV, _S.ABORTED),
        T(_SE.preempt, _S.LOADING_KV, _S.WAITING),
    ),
    description=(
        "A request from arrival to completion. LOADING_KV: admitted while its prefix loads "
        "from the external store, holding the blocks it loads into (and, hybrid, a state "
        "slot) but no batch row (before schema 4: a row and every block of its prompt); "
        "`load_settled` (the policy's decision once the load finished or failed; a rowless "
        "load's admission into a row, from the front of the queue) moves it to RUNNING from "
        "the loaded boundary (or, after a failure, the last good block). Only a RUNNING "
        "sequence accepts `schedule_chunk` and `decode`, so a sequence still loading KV can "
        "never be scheduled. While the transfer flies an abort or end of session is recorded "
        "and applied once it ends; `abort` and `preempt` leave LOADING_KV only after the "
        "transfer ended (the transfer table refuses them before). A sequence migrated from a "
        "prefill worker arrives as a plain request whose prefix is loaded. With overlapped "
        "steps a sequence preempted while its token was in flight gets it in WAITING, and "
        "`finish` from there when that token ends it."
    ),
)


# --------------------------------------------------------------------------- KVLoad


class LoadState(IntEnum):
    """Lifecycle states of a KV-cache load from an external tier."""

    LOOKUP_PENDING = 0
    PLANNED = 1
    ADMITTED = 2
    ALLOCATED = 3
    LOADING = 4
    READY = 5
    FAILED = 6
    CANCELLED = 7


class LoadEvent(IntEnum):
    """Events applied to a KV load."""

    lookup_hit = 0
    lookup_miss = 1
    lookup_pending = 2
    admit = 3
    allocate = 4
    start = 5
    finish = 6
    fail = 7
    cancel = 8


_L, _LE = LoadState, LoadEvent

KVLOAD_SPEC = MachineSpec(
    name="KVLoad",
    states=LoadState,
    events=LoadEvent,
    initial=(_L.LOOKUP_PENDING,),
    terminal=(_L.READY, _L.FAILED, _L.CANCELLED),
    transitions=(
        T(_LE.lookup_hit, _L.LOOKUP_PENDING, _L.PLANNED),
        T(_LE.lookup_miss, _L.LOOKUP_PENDING, _L.CANCELLED),
        T(_LE.lookup_pending, _L.LOOKUP_PENDING, _L.LOOKUP_PENDING),
        T(_LE.admit, _L.PLANNED, _L.ADMITTED),
        T(_LE.allocate, _L.ADMITTED, _L.ALLOCATED),
        T(_LE.start, _L.ALLOCATED, _L.LOADING),
        T(_LE.start, _L.ADMITTED, _L.LOADING),
        T(_LE.finish, _L.LOADING, _L.READY),
        T(_LE.fail, _L.LOADING, _L.FAILED),
        T(_LE.cancel, _L.LOOKUP_PENDING, _L.CANCELLED),
        T(_LE.cancel, _L.PLANNED, _L.CANCELLED),
        T(_LE.cancel, _L.ADMITTED, _L.CANCELLED),
        T(_LE.cancel, _L.ALLOCATED, _L.CANCELLED),
    ),
    description=(
        "Loading a sequence's KV blocks (and, for a hybrid model, the state at the loaded "
        "boundary) from an external store. The lookup is asynchronous (it may stay pending "
        "for steps: each pending answer fires `lookup_pending`) or answered within the step "
        "that starts it (a lookup port: LOOKUP_PENDING -> PLANNED or CANCELLED at once); "
        "PLANNED -> ADMITTED -> "
        "ALLOCATED -> LOADING happen in one admission (the destination blocks, transfer "
        "start; ADMITTED -> LOADING directly for a hybrid load of the state alone, which "
        "allocates no block; a synchronous load, which the executor runs before the forward "
        "of the step that first runs the sequence, also LOADING -> READY). A load can be "
        "cancelled until its "
        "transfer starts; once LOADING it either finishes or fails (with the number of good "
        "leading blocks: the sequence recomputes from there)."
    ),
)


# --------------------------------------------------------------------------- KVSave


class SaveState(IntEnum):
    """Lifecycle states of a KV-cache save to an external tier."""

    PENDING = 0
    SAVING = 1
    SAVED = 2
    FAILED = 3


class SaveEvent(IntEnum):
    """Events applied to a KV save."""

    start = 0
    confirm = 1
    fail = 2


_V, _VE = SaveState, SaveEvent

KVSAVE_SPEC = MachineSpec(
    name="KVSave",
    states=SaveState,
    events=SaveEvent,
    initial=(_V.PENDING,),
    terminal=(_V.SAVED, _V.FAILED),
    transitions=(
        T(_VE.start, _V.PENDING, _V.SAVING),
        T(_VE.confirm, _V.SAVING, _V.SAVED),
        T(_VE.fail, _V.SAVING, _V.FAILED),
    ),
    description=(
        "Saving KV blocks (and, for a hybrid model, an aligned state checkpoint) to an "
        "external store. A save starts in the step that decides it and holds a lease (block "
        "references, a checkpoint pin) until the store confirms or fails it; a save is never "
        "cancelled (its blocks stay leased until the store answers). A serving engine's "
        "connector that saves on its own asks to keep a sequence's blocks past its end "
        "(`KVHoldRequested`, an input): the same lease, until it releases them "
        "(`KVHoldReleased`)."
    ),
)


# --------------------------------------------------------------------------- Checkpoint


class CkptState(IntEnum):
    """Lifecycle states of a cached checkpoint."""

    RESERVED = 0
    PUBLISHED = 1
    PINNED = 2
    RELEASED = 3
    EVICTED = 4


class CkptEvent(IntEnum):
    """Events applied to a checkpoint."""

    publish = 0
    abandon = 1
    pin = 2
    unpin = 3
    evict = 4
    release = 5


_C, _CE = CkptState, CkptEvent

CHECKPOINT_SPEC = MachineSpec(
    name="Checkpoint",
    states=CkptState,
    events=CkptEvent,
    initial=(_C.RESERVED,),
    terminal=(_C.RELEASED, _C.EVICTED),
    transitions=(
        T(_CE.publish, _C.RESERVED, _C.PUBLISHED),
        T(_CE.abandon, _C.RESERVED, _C.RELEASED),
        T(_CE.pin, _C.PUBLISHED, _C.PINNED),
        T(_CE.pin, _C.PINNED, _C.PINNED),
        T(_CE.unpin, _C.PINNED, _C.PUBLISHED, "last_pin"),
        T(_CE.unpin, _C.PINNED, _C.PINNED, "more_pins"),
        T(_CE.evict, _C.PUBLISHED, _C.EVICTED),
        T(_CE.release, _C.PUBLISHED, _C.RELEASED),
    ),
    description=(
        "A reusable checkpoint slot. `abandon` rolls back a reservation whose publish failed "
        "(or that a duplicate superseded). A PINNED checkpoint has no edge to EVICTED or "
        "RELEASED: it must be unpinned first. Index entries are removed by the fold that "
        "evicts or releases, so no stale entry can exist."
    ),
)


# --------------------------------------------------------------------------- PrefillTurn


class TurnState(IntEnum):
    """The kind of the engine's current prefill turn (lmdeploy's _PrefillTurnPolicy)."""

    STANDARD = 0
    SHORT_ONLY = 1
    LONG_FIRST = 2
    LONG_FIRST_IF_FINAL = 3


class TurnEvent(IntEnum):
    """The policy's choice of a turn."""

    no_long_work = 0
    short_turn = 1
    long_turn = 2
    final_long_turn = 3
    fall_back = 4


_T, _TE = TurnState, TurnEvent

PREFILL_TURN_SPEC = MachineSpec(
    name="PrefillTurn",
    states=TurnState,
    events=TurnEvent,
    initial=(_T.STANDARD, _T.SHORT_ONLY, _T.LONG_FIRST, _T.LONG_FIRST_IF_FINAL),
    terminal=(),
    transitions=(
        T(_TE.no_long_work, _T.SHORT_ONLY, _T.STANDARD),
        T(_TE.no_long_work, _T.LONG_FIRST, _T.STANDARD),
        T(_TE.short_turn, _T.STANDARD, _T.SHORT_ONLY),
        T(_TE.short_turn, _T.LONG_FIRST, _T.SHORT_ONLY),
        T(_TE.long_turn, _T.STANDARD, _T.LONG_FIRST),
        T(_TE.long_turn, _T.SHORT_ONLY, _T.LONG_FIRST),
        T(_TE.long_turn, _T.LONG_FIRST_IF_FINAL, _T.LONG_FIRST),
        T(_TE.final_long_turn, _T.LONG_FIRST, _T.LONG_FIRST_IF_FINAL),
        T(_TE.fall_back, _T.SHORT_ONLY, _T.LONG_FIRST),
        T(_TE.fall_back, _T.LONG_FIRST_IF_FINAL, _T.LONG_FIRST),
    ),
    description=(
        "The engine's prefill turn (one per engine; `turns.policy`, lmdeploy's "
        "_PrefillTurnPolicy). STANDARD: no turn rule, the order policy's own order (fcfs and "
        "priority always take it; under ttft: short prefills by size, then long ones). "
        "SHORT_ONLY: short prefills by size; long ones (more than a chunk of tokens left "
        "after the prefix match) are not scheduled. LONG_FIRST: one long prefill first, then "
        "the short ones by size, then the other long ones. LONG_FIRST_IF_FINAL: that order, "
        "long prefills not scheduled. Each policy starts in its state; `standard` and "
        "`long_first` never leave it; `short_only` and `long_first_if_final` leave it for "
        "LONG_FIRST when only long work waits (`long_turn`) or when their turn scheduled "
        "nothing while long work waits (`fall_back`). `interleave` (lmdeploy's engine) "
        "starts in STANDARD, the state without long work; with long work it takes "
        "`short_turn`s until `turns.short_per_long` of them ran since the last long chunk, "
        "then a `long_turn`. A turn equal to the current state is not an event."
    ),
)


ALL_SPECS: tuple[MachineSpec, ...] = (
    SEQUENCE_SPEC, KVLOAD_SPEC, KVSAVE_SPEC, CHECKPOINT_SPEC, PREFILL_TURN_SPEC
)

SEQUENCE: CompiledMachine = compile_spec(SEQUENCE_SPEC)
KVLOAD: CompiledMachine = compile_spec(KVLOAD_SPEC)
KVSAVE: CompiledMachine = compile_spec(KVSAVE_SPEC)
CHECKPOINT: CompiledMachine = compile_spec(CHECKPOINT_SPEC)
PREFILL_TURN: CompiledMachine = compile_spec(PREFILL_TURN_SPEC)

ALL_MACHINES: tuple[CompiledMachine, ...] = (SEQUENCE, KVLOAD, KVSAVE, CHECKPOINT, PREFILL_TURN)
