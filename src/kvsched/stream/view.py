"""CacheView: what a follower of the event stream can know, rebuilt from the events alone.

A KV-cache-aware router, a dashboard or an auditor in another process sees only the stream
(each step's inputs, then its decisions). ``CacheView`` folds that stream into:

* the prefix index: block hash -> block id, with each hash's parent hash
  (``BlocksCached`` adds, ``BlocksEvicted`` removes, ``CacheCleared`` empties);
* the checkpoint index: state identity -> checkpoint id (``CheckpointReserved`` names the
  identity, ``CheckpointPublished`` enters it, ``CheckpointEvicted`` / ``CheckpointReleased``
  remove it);
* each live sequence's lifecycle state and block table;
* counters: arrivals, admissions, prefix-hit tokens, preemptions, evictions (of blocks and of
  checkpoints), finishes.

It shares no code with the scheduler's reducers on purpose: the test that rebuilds a run's
cache from the stream and compares it with the engine's own owners checks both sides.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from kvsched.events import types as ev
from kvsched.events.codec import StepRecord

__all__ = ["CacheView", "SeqView"]


@attrs.define
class SeqView:
    state: str = "WAITING"
    blocks: list[int] = attrs.field(factory=list)
    overlap: int = 0  # MTP: the cached block it holds besides its table (PrefixMatched)
    overlap_at: int = -1


@attrs.define
class Counters:
    steps: int = 0
    arrived: int = 0
    rejected: int = 0
    admitted: int = 0
    loads_admitted: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    preempted: int = 0
    finished: int = 0
    aborted: int = 0
    blocks_cached: int = 0
    blocks_evicted: int = 0
    ckpts_published: int = 0
    ckpts_evicted: int = 0  # evicted for room (a drain's release is not counted)


def _segments(counts: np.ndarray) -> list[tuple[int, int]]:
    ends = np.cumsum(counts).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


class CacheView:
    """``strict=False``: a follower that joined late cannot place events about sequences or
    checkpoints it never saw; it skips them (counted in ``skipped``) instead of raising."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.skipped = 0
        self.prefix: dict[bytes, int] = {}
        self.parents: dict[bytes, bytes] = {}
        self.checkpoints: dict[bytes, int] = {}
        self._ckpt_keys: dict[int, bytes] = {}
        self.seqs: dict[int, SeqView] = {}
        self.counters = Counters()
        self.step = 0
        # Arrivals of this step not yet known to be accepted (a step's inputs come before
        # its decisions; a RequestRejected of an id cancels one arrival of it).
        self._arrivals: dict[int, int] = {}

    # ------------------------------------------------------------------------ folding

    def apply_record(self, record: StepRecord) -> None:
        for event in (*record.inputs, *record.decisions):
            self.apply(event)

    def apply(self, e: ev.Event) -> None:
        handler = getattr(self, "_on_" + type(e).__name__, None)
        if handler is None:
            return
        if self.strict:
            handler(e)
            return
        try:
            handler(e)
        except (KeyError, IndexError):
            self.skipped += 1

    def _seq(self, seq_id: int) -> SeqView:
        seq = self.seqs.get(seq_id)
        if seq is None:
            self._accept_arrivals()
            seq = self.seqs[seq_id]
        return seq

    def _accept_arrivals(self) -> None:
        for seq_id in self._arrivals:
            self.seqs[seq_id] = SeqView()
        self._arrivals.clear()

    def _on_StepStarted(self, e: ev.StepStarted) -> None:
        self._accept_arrivals()
        self.step = e.step
        self.counters.steps += 1

    def _on_RequestArrived(self, e: ev.RequestArrived) -> None:
        if e.seq_id not in self.seqs:  # (an id already live is a duplicate: rejected)
            self._arrivals[e.seq_id] = self._arrivals.get(e.seq_id, 0) + 1
        self.counters.arrived += 1

    def _on_RequestRejected(self, e: ev.RequestRejected) -> None:
        left = self._arrivals.get(e.seq_id, 0) - 1
        if left > 0:
            self._arrivals[e.seq_id] = left
        else:
            self._arrivals.pop(e.seq_id, None)
        self.counters.rejected += 1

    def _on_SequenceAdmitted(self, e: ev.SequenceAdmitted) -> None:
        self._seq(e.seq_id).state = "RUNNING"
        self.counters.admitted += 1

    def _on_KVLoadAdmitted(self, e: ev.KVLoadAdmitted) -> None:
        self._seq(e.seq_id).state = "LOADING_KV"
        self.counters.loads_admitted += 1

    def _on_KVLoadSettled(self, e: ev.KVLoadSettled) -> None:
        self._seq(e.seq_id).state = "RUNNING"

    def _on_SequencePreempted(self, e: ev.SequencePreempted) -> None:
        self.seqs[e.seq_id] = SeqView()
        self.counters.preempted += 1

    def _on_SequenceFinished(self, e: ev.SequenceFinished) -> None:
        for seq_id in e.seq_ids.tolist():
            del self.seqs[seq_id]
        self.counters.finished += len(e.seq_ids)

    def _on_SequenceAborted(self, e: ev.SequenceAborted) -> None:
        self._seq(e.seq_id)
        del self.seqs[e.seq_id]
        self.counters.aborted += 1

    def _on_PrefixMatched(self, e: ev.PrefixMatched) -> None:
        seq = self._seq(e.seq_id)
        seq.blocks = e.blocks.tolist()
        seq.overlap, seq.overlap_at = e.overlap_block, len(e.blocks) if e.overlap_block else -1
        if e.num_query_tokens:
            self.counters.query_tokens += e.num_query_tokens
            self.counters.hit_tokens += e.num_tokens

    def _on_BlocksAllocated(self, e: ev.BlocksAllocated) -> None:
        blocks = e.blocks.tolist()
        for seq_id, (lo, hi) in zip(e.seq_ids.tolist(), _segments(e.counts), strict=True):
            self._seq(seq_id).blocks.extend(blocks[lo:hi])

    def _on_BlocksFreed(self, e: ev.BlocksFreed) -> None:
        for holder, (lo, hi) in zip(e.seq_ids.tolist(), _segments(e.counts), strict=True):
            if holder >= 0:  # a sequence drops its tail (a session's hold is not a table)
                seq = self.seqs[holder]
                n = hi - lo
                if seq.overlap and seq.overlap in e.blocks[lo:hi].tolist():
                    n -= 1  # (its MTP overlap block is not in its table)
                    seq.overlap, seq.overlap_at = 0, -1
                del seq.blocks[len(seq.blocks) - n :]

    def _on_SessionBlocksHeld(self, e: ev.SessionBlocksHeld) -> None:
        seq = self.seqs[e.seq_id]
        private = [seq.blocks[seq.overlap_at]] if 0 <= seq.overlap_at < len(e.blocks) else []
        if private:  # the session holds the MTP overlap; its private copy stays, to be freed
            seq.overlap, seq.overlap_at = 0, -1
        seq.blocks[: len(e.blocks)] = private

    def _on_BlocksCached(self, e: ev.BlocksCached) -> None:
        hashes, parents = ev.split_hashes(e.hashes), ev.split_hashes(e.parents)
        blocks, replaced, starts = e.blocks.tolist(), e.replaced.tolist(), e.starts.tolist()
        for i, (lo, hi) in enumerate(_segments(e.counts)):
            table = self.seqs[int(e.seq_ids[i])].blocks
            for j in range(lo, hi):
                if replaced[j] > 0:  # deduplicated onto the cached copy
                    table[starts[i] + j - lo] = blocks[j]
                elif replaced[j] == 0:  # (a private copy is not indexed)
                    self.prefix[hashes[j]] = blocks[j]
                    self.parents[hashes[j]] = parents[j]
                    self.counters.blocks_cached += 1

    def _on_BlocksEvicted(self, e: ev.BlocksEvicted) -> None:
        for h in ev.split_hashes(e.hashes):
            del self.prefix[h]
            self.parents.pop(h, None)
        self.counters.blocks_evicted += len(e.blocks)

    def _on_CacheCleared(self, e: ev.CacheCleared) -> None:
        self.counters.blocks_evicted += len(self.prefix)
        self.prefix.clear()
        self.parents.clear()

    def _on_CheckpointReserved(self, e: ev.CheckpointReserved) -> None:
        self._ckpt_keys[e.ckpt_id] = e.key

    def _on_CheckpointPublished(self, e: ev.CheckpointPublished) -> None:
        self.checkpoints[self._ckpt_keys[e.ckpt_id]] = e.ckpt_id
        self.counters.ckpts_published += 1

    def _drop_checkpoint(self, ckpt_id: int) -> None:
        key = self._ckpt_keys.pop(ckpt_id)
        if self.checkpoints.get(key) == ckpt_id:
            del self.checkpoints[key]

    def _on_CheckpointAbandoned(self, e: ev.CheckpointAbandoned) -> None:
        self._drop_checkpoint(e.ckpt_id)

    def _on_CheckpointReleased(self, e: ev.CheckpointReleased) -> None:
        self._drop_checkpoint(e.ckpt_id)

    def _on_CheckpointEvicted(self, e: ev.CheckpointEvicted) -> None:
        self._drop_checkpoint(e.ckpt_id)
        self.counters.ckpts_evicted += 1

    def _on_CheckpointUnpinned(self, e: ev.CheckpointUnpinned) -> None:
        self.seqs[e.seq_id].blocks.clear()  # the pinned prefix was all that was left

    # ------------------------------------------------------------------------ queries

    def hit_rate(self) -> float:
        q = self.counters.query_tokens
        return self.counters.hit_tokens / q if q else 0.0

    def summary(self) -> dict[str, Any]:
        """A flat, JSON-friendly summary (what ``kvsched watch`` prints)."""
        self._accept_arrivals()
        running = sum(s.state == "RUNNING" for s in self.seqs.values())
        return {
            "step": self.step,
            **attrs.asdict(self.counters),
            "token_hit_rate": round(self.hit_rate(), 4),
            "cached_blocks": len(self.prefix),
            "checkpoints": len(self.checkpoints),
            "running": running,
            "waiting": sum(s.state == "WAITING" for s in self.seqs.values()),
            "blocks_in_tables": sum(len(s.blocks) for s in self.seqs.values()),
        }

    def snapshot(self) -> dict[str, Any]:
        """The rebuilt view as JSON-friendly data (hashes in hex)."""
        self._accept_arrivals()
        return {
            "prefix": {h.hex(): b for h, b in sorted(self.prefix.items())},
            "parents": {h.hex(): p.hex() for h, p in sorted(self.parents.items())},
            "checkpoints": {k.hex(): c for k, c in sorted(self.checkpoints.items())},
            "seqs": {str(k): [s.state, s.blocks] for k, s in sorted(self.seqs.items())},
        }


def engine_view(state: Any) -> dict[str, Any]:
    """The same snapshot, read from an engine's owners (an ``EngineState``), to compare a
    rebuilt view with the engine it followed."""
    t, pool = state.seqs, state.pool
    seqs = {}
    for seq_id, seq in sorted(t.seqs.items()):
        blocks = t.block_table(seq).tolist()  # (a load without a row holds its own)
        seqs[str(seq_id)] = [seq.state.name, blocks]
    return {
        "prefix": {h.hex(): b for h, b in sorted(pool.index.items())},
        "parents": {h.hex(): pool.parent_of[b].hex() for h, b in sorted(pool.index.items())},
        "checkpoints": {k.hex(): c for k, c in sorted(state.ckpts.index.items())},
        "seqs": seqs,
    }
