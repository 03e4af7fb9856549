"""The vocabulary of facts: every event kvsched records.

Events are frozen ``msgspec.Struct`` records, encoded as msgpack maps with field names and a
short ``type`` tag (fields at their default value are omitted), so a reader can tell every
field by name and a later schema can add fields with defaults (``events/codec.py`` holds the
schema version). Events that concern many sequences are batch-shaped: they carry numpy arrays,
and a ragged per-sequence list (for example the blocks each sequence received) is stored in
CSR form (``counts`` plus one flat array). Block hashes travel as ``bytes`` of concatenated
16-byte digests. Arrays inside events are never mutated after construction.

Two families:

* **inputs** come from outside the scheduler (clients, the executor, the KV store). Replay
  feeds them back in.
* **decisions** are what the scheduler decided, including every change of the prefix cache
  (``BlocksCached``, ``BlocksEvicted``, ``CacheCleared``) and of each checkpoint, so a
  subscriber that sees only the stream can follow the cache. Replay recomputes them and
  compares.
"""

from __future__ import annotations

import msgspec
import numpy as np

I32 = np.int32
I64 = np.int64


HASH_SIZE = 16  # bytes per block hash in ``hashes`` / ``parents`` fields


class Event(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """Base of every event."""


def split_hashes(blob: bytes) -> list[bytes]:
    """The 16-byte digests of a ``hashes`` field, in order."""
    n = HASH_SIZE
    return [blob[i : i + n] for i in range(0, len(blob), n)]


class MultimodalSpan(msgspec.Struct, frozen=True):
    """Prompt positions [start, end) filled by one image/video, with its content hash."""

    start: int
    end: int
    content_hash: bytes


# ---------------------------------------------------------------------------- inputs


class RequestArrived(Event, frozen=True, tag="arrived"):
    seq_id: int
    prompt: np.ndarray  # int32 token ids (for a session turn: the new tokens only)
    max_tokens: int
    arrival_time: float = 0.0
    priority: int = 0
    session_id: int = -1
    adapter: str = ""
    cache_salt: str = ""
    eos_token_id: int = -1
    temperature: float = 0.0
    seed: int = 0
    mm_spans: tuple[MultimodalSpan, ...] = ()
    return_routed_experts: bool = False
    # The caller's digests of the sequence's first full blocks (16 bytes each, e.g. vLLM's
    # Request.block_hashes): used instead of computing them (identity.py). Empty: computed.
    block_hashes: bytes = b""


class RequestAborted(Event, frozen=True, tag="aborted"):
    seq_id: int
    reason: str = "client abort"


class SessionEnded(Event, frozen=True, tag="session_end"):
    session_id: int


SLEEP_LEVELS = (1, 2)  # 1: the executor releases its KV cache; 2: its weights too


class DrainRequested(Event, frozen=True, tag="drain"):
    """Release everything held (sleep); no admissions until ``WakeRequested``. ``level``
    (``SLEEP_LEVELS``): what the executor releases once drained (``Drained.level``)."""

    level: int = 1


class WakeRequested(Event, frozen=True, tag="wake"):
    pass


class StepExecuted(Event, frozen=True, tag="executed"):
    """Outcome of a step: the tokens sampled for the sequences that sampled."""

    step: int
    seq_ids: np.ndarray  # int64
    tokens: np.ndarray  # int32
    duration_s: float = 0.0
    # MoE: routed-expert ids of every computed token, in plan token order, flattened
    # [num_tokens * routed_experts_per_token] (int16); empty when not recorded.
    routed_experts: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.int16))


class StepFailed(Event, frozen=True, tag="step_failed"):
    """The executor raised while running a step's plan."""

    step: int
    reason: str


class KVLookupAnswered(Event, frozen=True, tag="kv_lookup"):
    seq_id: int
    num_blocks: int
    pending: bool = False


class KVLoadFinished(Event, frozen=True, tag="kv_load_done"):
    seq_id: int


class KVLoadFailed(Event, frozen=True, tag="kv_load_failed"):
    seq_id: int
    num_good_blocks: int
    reason: str


class KVSaveFinished(Event, frozen=True, tag="kv_save_done"):
    save_id: int
    ok: bool = True


# ------------------------------------------------------------------------- decisions


class StepStarted(Event, frozen=True, tag="step"):
    step: int
    clock: float


class RequestRejected(Event, frozen=True, tag="rejected"):
    seq_id: int
    reason: str


class SequenceAdmitted(Event, frozen=True, tag="admitted"):
    seq_id: int
    row: int  # batch slot


class PrefixMatched(Event, frozen=True, tag="matched"):
    """Cached blocks attached to a sequence at admission (the first ``num_tokens`` tokens)."""

    seq_id: int
    blocks: np.ndarray  # int32
    num_tokens: int
    num_query_tokens: int
    ckpt_id: int = -1  # hybrid: the pinned checkpoint whose path covers ``blocks``
    kv_hit_tokens: int = -1  # hybrid: tokens the KV cache alone would have matched
    # MTP: the cached block at index len(blocks) of the sequence's chain, which it recomputes
    # into a private block (its block-table entry) and holds while it runs, so that the cached
    # block stays shared and its later blocks chain from it (0: none)
    overlap_block: int = 0


class BlocksAllocated(Event, frozen=True, tag="alloc"):
    seq_ids: np.ndarray  # int64
    counts: np.ndarray  # int32, blocks per sequence
    blocks: np.ndarray  # int32, concatenated


class BlocksFreed(Event, frozen=True, tag="free"):
    """References dropped by sequences (or sessions, ``seq_ids`` < 0 is ``-session_id - 1``)."""

    seq_ids: np.ndarray
    counts: np.ndarray
    blocks: np.ndarray


PRIVATE_COPY = -1  # BlocksCached.replaced: a duplicate the sequence keeps, not indexed
UNINDEXED = -2  # BlocksCached.replaced: a block after a private copy: kept, not indexed


class BlocksCached(Event, frozen=True, tag="cached"):
    """Computed full blocks of running sequences enter the prefix index.

    Per sequence ``seq_ids[i]`` (CSR with ``counts``), its blocks ``starts[i], starts[i] + 1,
    ...`` of the block table: entry ``j`` is block ``blocks[j]`` with hash ``hashes[j]`` whose
    parent hash is ``parents[j]`` (the namespace root for block 0 of a chain). An entry with
    ``replaced[j] != 0`` is a deduplication: the hash was already cached at ``blocks[j]``, which
    replaces the sequence's own copy ``replaced[j]`` in its block table (the copy is freed).
    ``replaced[j] == PRIVATE_COPY`` (-1): the hash is already cached on another block and the
    sequence keeps ``blocks[j]`` as a private copy, not indexed (``dedup_cached_blocks`` off).
    ``replaced[j] == UNINDEXED`` (-2): a later block of a sequence whose chain runs through a
    private copy; it is kept and not indexed either (indexed, it would hang under a cached
    block the sequence does not hold, which could be evicted from under it). MoE:
    ``with_experts[j]`` marks entries whose routed-expert ids (``experts``, flat
    ``[block_size * K]`` per marked entry) the cache keeps from now on."""

    seq_ids: np.ndarray  # int64
    counts: np.ndarray  # int32
    starts: np.ndarray  # int32
    blocks: np.ndarray  # int32
    replaced: np.ndarray  # int32, 0: a new cache entry; PRIVATE_COPY, UNINDEXED: not indexed
    hashes: bytes  # 16 bytes per entry
    parents: bytes  # 16 bytes per entry
    with_experts: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.bool_))
    experts: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.int16))


class BlocksEvicted(Event, frozen=True, tag="evicted"):
    """Cached blocks no one holds lose their identity (least recently released first, leaf
    before parent) so that the allocation that follows can reuse them."""

    blocks: np.ndarray  # int32
    hashes: bytes  # 16 bytes per block


class CacheCleared(Event, frozen=True, tag="cache_cleared"):
    """Every cached block loses its identity (nothing is held): the prefix index is empty."""


class SessionBlocksHeld(Event, frozen=True, tag="session_hold"):
    """A finished turn hands its full blocks to its session for the next turn."""

    session_id: int
    seq_id: int
    blocks: np.ndarray


class PrefillScheduled(Event, frozen=True, tag="prefill"):
    """Compute tokens [start, end) of each sequence this step."""

    seq_ids: np.ndarray
    starts: np.ndarray
    ends: np.ndarray


class DecodeScheduled(Event, frozen=True, tag="decode"):
    seq_ids: np.ndarray


class SequencePreempted(Event, frozen=True, tag="preempted"):
    seq_id: int
    reason: str = "blocks"


def _no_counts() -> np.ndarray:
    return np.zeros(0, np.int64)


class SequenceFinished(Event, frozen=True, tag="finished"):
    """Sequences retired (reason "stop", "length" or "migrated"). With
    ``config.report_cached_tokens``, per sequence the prompt tokens its first admission took
    without computing them (as vLLM's ``num_cached_tokens``), by source: local prefix hits
    (KV blocks), a hybrid model's restored checkpoint, blocks loaded from the external store;
    empty arrays otherwise (and in logs before schema 4)."""

    seq_ids: np.ndarray
    reasons: tuple[str, ...]
    cached_local: np.ndarray = msgspec.field(default_factory=_no_counts)  # int64
    cached_checkpoint: np.ndarray = msgspec.field(default_factory=_no_counts)
    cached_external: np.ndarray = msgspec.field(default_factory=_no_counts)


class SequenceAborted(Event, frozen=True, tag="seq_aborted"):
    seq_id: int
    reason: str
    # A session's aborted turn stays in its history (its tokens, generated ones included,
    # continue in the next turn, as lmdeploy keeps a stopped turn): config keep_aborted_turns.
    keep_history: bool = False
    # the prompt tokens its first admission did not compute (as on SequenceFinished)
    cached_local: int = 0
    cached_checkpoint: int = 0
    cached_external: int = 0


class SessionClosed(Event, frozen=True, tag="session_closed"):
    session_id: int


class Drained(Event, frozen=True, tag="drained"):
    """Nothing is held or cached: the driver now lets the executor sleep at ``level``
    (1: release the KV cache; 2: the weights too)."""

    level: int = 1


class Woken(Event, frozen=True, tag="woken"):
    """Serving resumes: the driver wakes the executor before it runs this step's plan."""


class CheckpointReserved(Event, frozen=True, tag="ckpt_reserved"):
    """Save the state of ``seq_id`` after ``num_tokens`` tokens into ``slot`` (and, for a
    non-aligned step, its partial block into ``frozen_block``). ``key`` is the checkpoint's
    identity (the index key once published); ``anchor`` the hash of its last full block (the
    namespace root below one block); ``kind`` the placement rule that chose it
    (``config.PLACEMENTS``). ``phase``: when this step's executor saves it: "after" the
    forward (the state at the end of the sequence's work of this step), "within" the forward
    (mid-chunk, at a block boundary), or "before" it (a sequence that finished in the step
    just executed: its runtime slot still holds its final state)."""

    ckpt_id: int
    seq_id: int
    slot: int
    num_tokens: int
    key: bytes
    anchor: bytes
    frozen_block: int = 0
    kind: str = ""
    phase: str = "after"


class CheckpointPublished(Event, frozen=True, tag="ckpt_published"):
    ckpt_id: int


class CheckpointPinned(Event, frozen=True, tag="ckpt_pinned"):
    ckpt_id: int
    seq_id: int


class CheckpointUnpinned(Event, frozen=True, tag="ckpt_unpinned"):
    ckpt_id: int
    seq_id: int


class CheckpointAbandoned(Event, frozen=True, tag="ckpt_abandoned"):
    """A reserved checkpoint is dropped before publication (its step failed, or a checkpoint
    of the same identity was published first)."""

    ckpt_id: int
    reason: str


class CheckpointReleased(Event, frozen=True, tag="ckpt_released"):
    """A published checkpoint is released (drain): its slot and references go."""

    ckpt_id: int
    reason: str


class CheckpointEvicted(Event, frozen=True, tag="ckpt_evicted"):
    """An unpinned checkpoint is evicted for room; ``priority``: its eviction priority under
    the "value" eviction (the table's aging floor rises to it), else None."""

    ckpt_id: int
    priority: float | None = None


class KVLookupStarted(Event, frozen=True, tag="kv_lookup_started"):
    """Ask the external store how many blocks of the chain ``[first_block, num_blocks)`` it
    holds (the engine has ``[0, first_block)`` itself)."""

    seq_id: int
    first_block: int
    num_blocks: int
    root: bytes  # the chain's namespace root (store keys are made of it and the hashes)
    hashes: bytes  # 16 bytes per block of [first_block, num_blocks)
    with_state: bool = False  # hybrid: a hit must end at a block with a stored state


class KVLoadCancelled(Event, frozen=True, tag="kv_load_cancelled"):
    """A lookup or planned load is dropped (abort, drain, or the local cache serves it)."""

    seq_id: int
    reason: str


class KVLoadAdmitted(Event, frozen=True, tag="kv_load_admitted"):
    """Admit a sequence whose chain blocks ``[first_block, num_blocks)`` are loaded from the
    store: it waits in LOADING_KV until the load settles. ``row`` -1: it takes no batch row
    and holds only its local prefix and the blocks it loads into (``load_admission="soft"``);
    else it takes batch row ``row`` (and every block of its prompt: before schema 4)."""

    seq_id: int
    row: int
    first_block: int
    num_blocks: int


class KVLoadStarted(Event, frozen=True, tag="kv_load_started"):
    """Load chain blocks ``[first_block, first_block + len(blocks))`` (hashes ``hashes``
    under ``root``) into ``blocks`` and, for a hybrid model, the state stored at the block
    with hash ``state_hash`` into ``state_slot``."""

    seq_id: int
    blocks: np.ndarray
    first_block: int
    root: bytes
    hashes: bytes  # 16 bytes per loaded block
    state_slot: int = -1
    state_hash: bytes = b""


class KVLoadSettled(Event, frozen=True, tag="kv_load_settled"):
    """The sequence's load ended (finished or failed): it runs from its first ``num_blocks``
    chain blocks (a failed load keeps its good leading blocks for an attention model, none
    beyond its local prefix for a hybrid model, which has no state there). A load without a
    row is settled when it is admitted: it takes batch row ``row`` with the blocks it holds
    and, hybrid, the loaded state is restored from ``state_slot`` into the row's runtime
    slot (the slot is freed)."""

    seq_id: int
    num_blocks: int
    row: int = -1
    state_slot: int = -1


class KVSaveStarted(Event, frozen=True, tag="kv_save_started"):
    """Save chain blocks ``[first_block, first_block + len(blocks))`` of ``seq_id`` under the
    keys made of ``root`` and ``hashes`` (and, for a hybrid model, checkpoint ``ckpt_id``'s
    state from ``state_slot`` under the last block's hash). The save holds a lease (block
    references on the whole prefix up to its last block, a checkpoint pin) until
    ``KVSaveFinished``."""

    save_id: int
    seq_id: int
    blocks: np.ndarray
    first_block: int
    root: bytes
    hashes: bytes  # 16 bytes per saved block
    ckpt_id: int = -1
    state_slot: int = -1


class AbortDeferred(Event, frozen=True, tag="abort_deferred"):
    """An abort (or end of session) of a sequence whose KV is loading: applied once the
    load has settled."""

    seq_id: int
    reason: str
    close_session: bool = False


class DrainDeferred(Event, frozen=True, tag="drain_deferred"):
    """Drain requested while loads or saves are in flight: it happens once they settle, at
    sleep ``level``."""

    level: int = 1


class PrefillTurnChosen(Event, frozen=True, tag="prefill_turn"):
    """The kind of prefill turn the policy takes from now on (the PrefillTurn machine), emitted
    only when it changes: ``turn`` is "standard", "short_only", "long_first" or
    "long_first_if_final"; ``fallback``: a gated turn that scheduled nothing while long
    prefills wait gives way to a long-first turn in the same step."""

    turn: str
    fallback: bool = False


INPUT_TYPES: tuple[type[Event], ...] = (
    RequestArrived,
    RequestAborted,
    SessionEnded,
    DrainRequested,
    WakeRequested,
    StepExecuted,
    StepFailed,
    KVLookupAnswered,
    KVLoadFinished,
    KVLoadFailed,
    KVSaveFinished,
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
