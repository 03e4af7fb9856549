"""Declarative lifecycles (Sequence, KVLoad, KVSave, Checkpoint), their compiled lookups, and
the declared map of which event fires which trigger (``triggers.py``, checked at import).

Rendering lives in :mod:`kvsched.statemachines.diagrams` (not imported here).
"""

from kvsched.statemachines.declare import (
    NO_FACTS,
    AmbiguousTransition,
    CompiledMachine,
    IllegalTransition,
    MachineDefinitionError,
    MachineSpec,
    Transition,
    build_machine,
    compile_spec,
    validate_spec,
)
from kvsched.statemachines.machines import (
    ALL_MACHINES,
    ALL_SPECS,
    CHECKPOINT,
    CHECKPOINT_SPEC,
    KVLOAD,
    KVLOAD_SPEC,
    KVSAVE,
    KVSAVE_SPEC,
    SEQUENCE,
    SEQUENCE_SPEC,
    CkptEvent,
    CkptState,
    LoadEvent,
    LoadState,
    SaveEvent,
    SaveState,
    SeqEvent,
    SeqState,
)
from kvsched.statemachines.triggers import EVENT_TRIGGERS, check_triggers, fire, fire_many

__all__ = [
    "ALL_MACHINES",
    "ALL_SPECS",
    "CHECKPOINT",
    "CHECKPOINT_SPEC",
    "EVENT_TRIGGERS",
    "KVLOAD",
    "KVLOAD_SPEC",
    "KVSAVE",
    "KVSAVE_SPEC",
    "NO_FACTS",
    "SEQUENCE",
    "SEQUENCE_SPEC",
    "AmbiguousTransition",
    "CkptEvent",
    "CkptState",
    "CompiledMachine",
    "IllegalTransition",
    "LoadEvent",
    "LoadState",
    "MachineDefinitionError",
    "MachineSpec",
    "SaveEvent",
    "SaveState",
    "SeqEvent",
    "SeqState",
    "Transition",
    "build_machine",
    "check_triggers",
    "compile_spec",
    "fire",
    "fire_many",
    "validate_spec",
]
