"""The vocabulary of facts: every event kvsched records.

Events are frozen ``msgspec.Struct`` records, encoded as msgpack maps with field names and a
short ``type`` tag (fields at their default value are omitted), so a reader can tell every
field by name and a later schema can add fields with defaults (``events/codec.py`` holds the
schema version). Events that concern many sequences are batch-shaped: they carry numpy arrays,
and a ragged per-sequence list (for example the blocks each sequence received) is stored in
CSR form (``counts`` plus one flat array). Block hashes travel as ``bytes`` of concatenated
16-byte digests. Arrays inside events are never mutated after construction.

The structs live by family (``base.py``, ``inputs.py``, ``decisions.py``, ``storage.py``);
this module gathers them, so ``from kvsched.events import types as ev`` names every event.
Two families:

* **inputs** come from outside the scheduler (clients, the executor, the KV store). Replay
  feeds them back in.
* **decisions** are what the scheduler decided, including every change of the prefix cache
  (``BlocksCached``, ``BlocksEvicted``, ``CacheCleared``) and of each checkpoint, so a
  subscriber that sees only the stream can follow the cache. Replay recomputes them and
  compares.
"""

from __future__ import annotations

import numpy as np

from kvsched.events.base import HASH_SIZE, I32, I64, Event, MultimodalSpan, split_hashes
from kvsched.events.decisions import (
    PRIVATE_COPY,
    UNINDEXED,
    AbortDeferred,
    BlocksAllocated,
    BlocksCached,
    BlocksEvicted,
    BlocksFreed,
    CacheCleared,
    DecodeScheduled,
    DrainDeferred,
    Drained,
    PrefillScheduled,
    PrefillTurnChosen,
    PrefixMatched,
    RequestRejected,
    SequenceAborted,
    SequenceAdmitted,
    SequenceFinished,
    SequencePreempted,
    SessionBlocksHeld,
    SessionClosed,
    StepStarted,
    Woken,
)
from kvsched.events.inputs import (
    SLEEP_LEVELS,
    AdmissionsHeld,
    DrainRequested,
    KVHoldReleased,
    KVHoldRequested,
    KVLoadFailed,
    KVLoadFinished,
    KVLookupAnswered,
    KVSaveFinished,
    RequestAborted,
    RequestArrived,
    SessionEnded,
    StepExecuted,
    StepFailed,
    WakeRequested,
)
from kvsched.events.storage import (
    CheckpointAbandoned,
    CheckpointEvicted,
    CheckpointPinned,
    CheckpointPublished,
    CheckpointReleased,
    CheckpointReserved,
    CheckpointUnpinned,
    KVLoadAdmitted,
    KVLoadCancelled,
    KVLoadSettled,
    KVLoadStarted,
    KVLookupStarted,
    KVSaveStarted,
)

__all__ = [
    "DECISION_TYPES",
    "HASH_SIZE",
    "I32",
    "I64",
    "INPUT_TYPES",
    "PRIVATE_COPY",
    "SLEEP_LEVELS",
    "UNINDEXED",
    "AbortDeferred",
    "AdmissionsHeld",
    "BlocksAllocated",
    "BlocksCached",
    "BlocksEvicted",
    "BlocksFreed",
    "CacheCleared",
    "CheckpointAbandoned",
    "CheckpointEvicted",
    "CheckpointPinned",
    "CheckpointPublished",
    "CheckpointReleased",
    "CheckpointReserved",
    "CheckpointUnpinned",
    "DecodeScheduled",
    "DrainDeferred",
    "DrainRequested",
    "Drained",
    "Event",
    "KVHoldReleased",
    "KVHoldRequested",
    "KVLoadAdmitted",
    "KVLoadCancelled",
    "KVLoadFailed",
    "KVLoadFinished",
    "KVLoadSettled",
    "KVLoadStarted",
    "KVLookupAnswered",
    "KVLookupStarted",
    "KVSaveFinished",
    "KVSaveStarted",
    "MultimodalSpan",
    "PrefillScheduled",
    "PrefillTurnChosen",
    "PrefixMatched",
    "RequestAborted",
    "RequestArrived",
    "RequestRejected",
    "SequenceAborted",
    "SequenceAdmitted",
    "SequenceFinished",
    "SequencePreempted",
    "SessionBlocksHeld",
    "SessionClosed",
    "SessionEnded",
    "StepExecuted",
    "StepFailed",
    "StepStarted",
    "WakeRequested",
    "Woken",
    "entity_of",
    "split_hashes",
]

INPUT_TYPES: tuple[type[Event], ...] = (
    RequestArrived,
    RequestAborted,
    SessionEnded,
    DrainRequested,
    WakeRequested,
    AdmissionsHeld,
    StepExecuted,
    StepFailed,
    KVLookupAnswered,
    KVLoadFinished,
    KVLoadFailed,
    KVSaveFinished,
    KVHoldRequested,
    KVHoldReleased,
)

DECISION_TYPES: tuple[type[Event], ...] = (
    StepStarted,
    RequestRejected,
    SequenceAdmitted,
    PrefixMatched,
    BlocksAllocated,
    BlocksFreed,
    BlocksCached,
    BlocksEvicted,
    CacheCleared,
    SessionBlocksHeld,
    PrefillScheduled,
    DecodeScheduled,
    SequencePreempted,
    SequenceFinished,
    SequenceAborted,
    SessionClosed,
    Drained,
    Woken,
    CheckpointReserved,
    CheckpointPublished,
    CheckpointPinned,
    CheckpointUnpinned,
    CheckpointAbandoned,
    CheckpointReleased,
    CheckpointEvicted,
    KVLookupStarted,
    KVLoadCancelled,
    KVLoadAdmitted,
    KVLoadStarted,
    KVLoadSettled,
    KVSaveStarted,
    AbortDeferred,
    DrainDeferred,
    PrefillTurnChosen,
)


def entity_of(event: Event) -> str:
    """A short name of the entity an event concerns, for divergence reports."""
    for field in ("seq_id", "ckpt_id", "save_id", "session_id"):
        value = getattr(event, field, None)
        if value is not None:
            return f"{field}={value}"
    seq_ids = getattr(event, "seq_ids", None)
    if isinstance(seq_ids, np.ndarray):
        head = ",".join(_plain_id(s) for s in seq_ids[:4])
        more = "..." if len(seq_ids) > 4 else ""
        return f"seq_ids=[{head}{more}]"
    return "engine"


def _plain_id(value: object) -> str:
    """An id as text (a damaged log may hold anything in an id array)."""
    try:
        return str(int(value))  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return repr(value)
