"""Decisions about requests, blocks and the batch: what the scheduler decided each step,
including every change of the prefix cache. Replay recomputes them and compares."""

from __future__ import annotations

import msgspec
import numpy as np

from kvsched.events.base import Event


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
    """Compute each sequence's newest token and, speculative decoding, the first
    ``num_drafts[i]`` of the draft tokens last proposed for it (None: none)."""

    seq_ids: np.ndarray
    num_drafts: np.ndarray | None = None  # int32


class SequencePreempted(Event, frozen=True, tag="preempted"):
    seq_id: int
    reason: str = "blocks"


def _no_counts() -> np.ndarray:
    return np.zeros(0, np.int64)


class SequenceFinished(Event, frozen=True, tag="finished"):
    """Sequences retired (reason "stop", "length" or "migrated"). With
    ``config.legacy.report_cached_tokens``, per sequence the prompt tokens its first admission took
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
