"""Events: the vocabulary of facts, their codec, the append-only log and the in-process bus."""

from kvsched.events.codec import StepRecord, decode_events, decode_record, encode, to_builtins
from kvsched.events.types import *  # noqa: F403
from kvsched.events.types import DECISION_TYPES, INPUT_TYPES, Event, entity_of

__all__ = [
    "DECISION_TYPES",
    "INPUT_TYPES",
    "Event",
    "StepRecord",
    "decode_events",
    "decode_record",
    "encode",
    "entity_of",
    "to_builtins",
]
