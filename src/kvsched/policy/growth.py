"""Blocks: allocation (with the evictions it needs), caching computed blocks, releases,
session holds, preemption victims and making room.

Every cache change is a decision of its own: an allocation that reuses cached blocks first
emits ``BlocksEvicted`` for them; computed full blocks enter the prefix index through
``BlocksCached`` (a block whose hash is already cached is deduplicated onto the cached copy,
or, with ``dedup_cached_blocks`` off, kept as the sequence's private copy).
"""

from __future__ import annotations

import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy.common import I32, I64, Emit
from kvsched.policy.eviction import BLOCK_EVICTION
from kvsched.reducers.blocks import BlockPool
from kvsched.reducers.sequences import Seq, SequenceTable
from kvsched.reducers.sessions import SessionTable
from kvsched.reducers.state import EngineState
from kvsched.statemachines import SeqState

_EMPTY16 = np.zeros(0, dtype=np.int16)
_NO_MARKS = np.zeros(0, dtype=np.bool_)


class Growth:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.bs = config.block_size
        self.block_eviction = BLOCK_EVICTION["lru"]()  # (the one order prefix closure admits)

    # ------------------------------------------------------------------ allocation

    def take_blocks(self, state: EngineState, n: int, emit: Emit) -> np.ndarray:
        """The blocks an allocation of ``n`` takes (the caller checked that ``n`` are
        available): free blocks first; when too few are free, the block eviction strategy's
        victims, evicted first (``BlocksEvicted``), come first in the allocation."""
        pool = state.pool
        fresh = pool.num_free
        if n <= fresh:  # (the common case: nothing to evict)
            return pool.free_top(n)
        assert n <= pool.num_available, f"{n} blocks are not available"
        evict = self.block_eviction.victims(pool, n - fresh)
        blocks = np.concatenate((evict, pool.free_top(fresh)))  # (read before the evictions)
        emit(ev.BlocksEvicted(evict, pool.hashes_of(evict)))
        return blocks

    def allocate(
        self,
        state: EngineState,
        seq_ids: np.ndarray | list[int],
        counts: np.ndarray | list[int],
        emit: Emit,
    ) -> None:
        """Allocate ``counts[i]`` blocks to sequence ``seq_ids[i]`` (nothing when they add up
        to none), after the evictions the allocation needs."""
        counts = np.asarray(counts, dtype=I32)
        total = int(counts.sum())
        if total > 0:
            blocks = self.take_blocks(state, total, emit)
            emit(ev.BlocksAllocated(np.asarray(seq_ids, dtype=I64), counts, blocks))

    # ------------------------------------------------------- decode preallocation

    def drafts_to_verify(self, state: EngineState, rows: np.ndarray) -> np.ndarray | None:
        """How many of its proposed drafts each decoding row verifies: at most
        ``speculation.max_drafts``, and none at or past the context's last position (vLLM's
        rule); None when no row has drafts. The caller asks only with ``max_drafts`` on and an
        attention model (a hybrid model's state per draft position is not modelled, so its
        drafts are ignored)."""
        k = self.config.speculation.max_drafts
        if not len(rows):
            return None
        t = state.seqs
        proposed = t.drafts_of(rows)
        if not proposed.any():
            return None
        room = self.config.model.max_context - 2 - t.computed_of(rows)
        drafts: np.ndarray = np.maximum(0, np.minimum(np.minimum(proposed, k), room))
        return drafts

    def decode_spares(self, state: EngineState, rows: np.ndarray, taken: int) -> np.ndarray:
        """Blocks each decoding row that must grow takes besides the ``taken`` ones, to hold
        its next ``decode_prealloc_tokens`` tokens too (never past the last position it can
        write): only from free blocks left after those, so no cached block is evicted for
        them; rows in order while they last."""
        t, bs = state.seqs, self.bs
        limit = np.minimum(t.token_limits(rows), self.config.model.max_context)
        last = np.minimum(t.computed_of(rows) + self.config.decode_prealloc_tokens, limit - 2)
        extra = np.maximum(0, last // bs - t.block_counts(rows))
        budget = state.pool.num_free - taken
        if budget <= 0 or not extra.any():
            return np.zeros(len(rows), I32)
        taken = np.minimum(np.cumsum(extra), budget)
        spares: np.ndarray = np.diff(taken, prepend=0).astype(I32)
        return spares

    def _spares(self, state: EngineState) -> tuple[np.ndarray, np.ndarray]:
        """(rows, blocks each keeps) of the running rows holding spare blocks: preallocated
        past the block of their newest token and of the drafts it verifies in this step,
        never written."""
        t = state.seqs
        rows = t.running_rows()
        written = t.planned_known(rows) + t.verifying_of(rows)  # (placeholders' too)
        keep = -(-written // self.bs)
        spare = t.block_counts(rows) > keep
        return rows[spare], keep[spare]

    def num_spares(self, state: EngineState) -> int:
        """Spare blocks that ``return_spares`` would give back (pure query)."""
        if not self.config.decode_prealloc_tokens:
            return 0
        rows, keep = self._spares(state)
        return int((state.seqs.block_counts(rows) - keep).sum())

    def return_spares(self, state: EngineState, emit: Emit) -> bool:
        """Give back every running row's spare blocks (True if there were any). Callers
        short of room do this before giving anything else up (a session hold, a checkpoint,
        a sequence), so preallocation causes no preemption or eviction of its own."""
        if not self.config.decode_prealloc_tokens:
            return False
        rows, keep = self._spares(state)
        if not len(rows):
            return False
        t = state.seqs
        ends = t.block_counts(rows)
        counts = (ends - keep).astype(I32)
        emit(ev.BlocksFreed(t.ids_at(rows), counts, t.blocks_in(rows, keep, ends)))
        return True

    # --------------------------------------------------------------------- caching

    def cache_computed(
        self,
        state: EngineState,
        emit: Emit,
        rows: np.ndarray | None = None,
        planned: bool = False,
    ) -> None:
        """Give identity to the blocks that became full and computed (of ``rows``, default
        every row: a free row has none, a loading row none until its load settles).

        ``planned`` (``cache_when_planned``): also the full blocks that the work just
        scheduled for ``rows`` computes, in the step that computes them (vLLM's
        ``allocate_slots`` -> ``cache_blocks``), so a later request of the same step may hit
        them: every executor writes the batch's KV of a layer (torch) or of each earlier row
        (fingerprint: rows in plan order, the writer scheduled first) before a reader reads
        it. A failed step takes them back (``uncache_failed``)."""
        t = state.seqs
        grown, firsts, lasts = t.rows_to_cache(rows, planned)
        if not len(grown):
            return
        pool = state.pool
        seq_ids = t.ids_at(grown)
        blocks = t.blocks_in(grown, firsts, lasts).astype(np.int32)
        hashes: list[bytes] = []
        parents: list[bytes] = []
        for row, first, last in zip(grown.tolist(), firsts.tolist(), lasts.tolist(), strict=True):
            seq = t.seq_at(row)
            chain = seq.hashes.digests(first, last)
            hashes += chain
            parents.append(seq.hashes[first - 1] if first else seq.root)
            parents += chain[:-1]
        replaced = np.zeros(len(blocks), dtype=np.int32)
        canonical = [pool.cached_block(h) for h in hashes]
        swap = self.config.dedup_cached_blocks
        if swap and (any(c is not None for c in canonical) or len(set(hashes)) < len(hashes)):
            _deduplicate(hashes, canonical, blocks, replaced)
        if not swap:
            entries = (hashes, canonical, blocks)
            _keep_private(t, pool, grown, firsts, lasts, entries, replaced)
        path = blocks
        if self.config.mtp_holds_overlap:
            path = self._keep_overlaps(t, grown, firsts, lasts, blocks, replaced)
        marks, experts = _NO_MARKS, _EMPTY16
        if self.config.model.routed_experts_per_token:
            marks, experts = self._cached_experts(state, grown, firsts, lasts, path)
        emit(
            ev.BlocksCached(
                seq_ids, (lasts - firsts).astype(I32), firsts.astype(I32), blocks,
                replaced, b"".join(hashes), b"".join(parents), marks, experts,
            )
        )

    def uncomputed(self, state: EngineState, seq: Seq) -> list[tuple[int, int, bytes]]:
        """(depth, block, identity) of the running ``seq``'s blocks in the prefix index that
        are not computed: cached at planning by a step that then failed (a pure query)."""
        t = state.seqs
        return t.indexed_from(seq.row, t.computed_at(seq.row) // self.bs)

    def uncache_failed(
        self, state: EngineState, entries: list[tuple[int, int, bytes]], emit: Emit
    ) -> None:
        """After a failed step under ``cache_when_planned``, its sequences preempted or
        aborted: evict the blocks it had cached at planning (``uncomputed`` entries) that
        are still indexed and that nobody holds now (nothing was written into them), the
        deepest first (a block's cached children before it)."""
        pool = state.pool
        evict = sorted(
            {(d, b, h) for d, b, h in entries if pool.cached_block(h) == b and pool.is_unheld(b)},
            reverse=True,
        )
        if evict:
            ids = np.asarray([b for _, b, _ in evict], dtype=np.int32)
            emit(ev.BlocksEvicted(ids, b"".join(h for _, _, h in evict)))

    @staticmethod
    def _keep_overlaps(
        t: SequenceTable,
        rows: np.ndarray,
        firsts: np.ndarray,
        lasts: np.ndarray,
        blocks: np.ndarray,
        replaced: np.ndarray,
    ) -> np.ndarray:
        """MTP: a sequence's private recompute of a cached block it holds (its overlap) is
        kept, not swapped for the cached block nor indexed (``PRIVATE_COPY``): its chain runs
        through the cached block. Returns the entries' chain blocks (the cached block for
        such a copy)."""
        chain = blocks
        j = 0
        for row, first, last in zip(rows.tolist(), firsts.tolist(), lasts.tolist(), strict=True):
            seq = t.seq_at(row)
            if seq.overlap_block and first <= seq.overlap_at < last:
                k = j + seq.overlap_at - first
                if chain is blocks:
                    chain = blocks.copy()
                blocks[k] = int(t.blocks_of(row)[seq.overlap_at])
                replaced[k] = ev.PRIVATE_COPY
                chain[k] = seq.overlap_block
            j += last - first
        return chain

    def _cached_experts(
        self,
        state: EngineState,
        rows: np.ndarray,
        firsts: np.ndarray,
        lasts: np.ndarray,
        blocks: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """MoE: which entries bring routed-expert ids into the cache, and the ids."""
        t, j = state.seqs, 0
        marks: list[bool] = []
        experts: list[np.ndarray] = []
        done: set[int] = set()
        for row, first, last in zip(rows.tolist(), firsts.tolist(), lasts.tolist(), strict=True):
            seq = t.seq_at(row)
            for i in range(first, last):
                mark = self._experts_of(state, seq, i, int(blocks[j]), done)
                marks.append(mark is not None)
                if mark is not None:
                    experts.append(mark)
                j += 1
        ids = np.concatenate(experts) if experts else _EMPTY16
        return np.asarray(marks, dtype=np.bool_), ids

    def _experts_of(
        self, state: EngineState, seq: Seq, i: int, canonical: int, done: set[int]
    ) -> np.ndarray | None:
        """The routed-expert ids block ``i`` adds to the cache (None: none to add)."""
        bs = self.bs
        if seq.n_experts < (i + 1) * bs or state.pool.has_experts(canonical) or canonical in done:
            return None
        assert seq.experts is not None
        done.add(canonical)
        return seq.experts[i * bs : (i + 1) * bs].reshape(-1).astype(np.int16)

    # -------------------------------------------------------------------- releases

    def end(
        self,
        state: EngineState,
        seqs: list[Seq],
        ending: ev.SequenceFinished | ev.SequenceAborted | ev.SequencePreempted,
        emit: Emit,
        keep_for_session: bool = False,
    ) -> None:
        """End sequences: release everything the live ones hold (``BlocksFreed``, then
        ``CheckpointUnpinned``), then emit their ``ending``. The only way the policy ends a
        sequence, so a release always comes before the end its fold requires (the sequence
        table and the load holdings refuse an end that finds blocks still held). A waiting
        sequence holds nothing; a session keeps its turn's cached full blocks; a load without
        a row keeps none for it."""
        table = state.seqs
        holders: list[int] = []
        counts: list[int] = []
        blocks: list[np.ndarray] = []
        unpins: list[Seq] = []
        for seq in seqs:
            if seq.state == SeqState.WAITING:
                continue
            row = seq.row
            held = table.held_blocks(seq)
            if seq.pinned_ckpt >= 0:
                unpins.append(seq)
            if keep_for_session and not state.hybrid and row >= 0 and (
                seq.session_id in state.sessions
            ):
                keep = table.registered_at(row)
                if keep:
                    # (the cached chain: an MTP overlap block, not its private copy)
                    chain = table.path_blocks(seq, 0, keep)
                    emit(ev.SessionBlocksHeld(seq.session_id, seq.seq_id, chain))
                    held = table.held_blocks(seq)
            if len(held):
                holders.append(seq.seq_id)
                counts.append(len(held))
                blocks.append(held.copy())
        if holders:
            ids, sizes = np.asarray(holders, dtype=I64), np.asarray(counts, dtype=I32)
            emit(ev.BlocksFreed(ids, sizes, np.concatenate(blocks)))
        for seq in unpins:
            emit(ev.CheckpointUnpinned(seq.pinned_ckpt, seq.seq_id))
        emit(ending)

    def free_session_hold(self, state: EngineState, session_id: int, emit: Emit) -> None:
        session = state.sessions.get(session_id)
        if session is not None and len(session.held):
            holder = SessionTable.holder_id(session_id)
            ids, sizes = np.asarray([holder], dtype=I64), np.asarray([len(session.held)], I32)
            emit(ev.BlocksFreed(ids, sizes, session.held.copy()))

    def preempt(self, state: EngineState, seq: Seq, emit: Emit, reason: str) -> None:
        self.end(state, [seq], ev.SequencePreempted(seq.seq_id, reason), emit)

    def reclaim_sessions(
        self, state: EngineState, need: int, emit: Emit, keep: int, hit: np.ndarray | None = None
    ) -> None:
        """Free idle sessions' held blocks (least recently used first, or lowest session id
        first: ``session_reclaim``) until ``need`` are available (not counting the cached
        ``hit`` blocks, which an admission attaches)."""
        pool = state.pool
        sessions = state.sessions
        if self.config.legacy.session_reclaim == "last_use":
            order = sorted(sessions, key=lambda k: (sessions[k].last_used, k))
        else:
            order = sorted(sessions)
        for session_id in order:
            unheld = pool.count_unheld(hit) if hit is not None and len(hit) else 0
            if pool.num_available - unheld >= need:
                return
            if session_id != keep:
                self.free_session_hold(state, session_id, emit)

    def reclaim_gain(self, state: EngineState, keep: int, hit: np.ndarray) -> int:
        """How many blocks freeing every idle session's hold but ``keep``'s would make
        available to an admission attaching ``hit`` (pure query)."""
        pool = state.pool
        drops = np.zeros(pool.num_blocks, dtype=np.int64)
        for session_id, session in state.sessions.items():
            if session_id != keep and len(session.held):
                drops[session.held] += 1  # a holder never holds a block twice
        drops[hit] = 0  # a hit block set loose is attached again: no gain
        return int(np.count_nonzero(pool.freed_by(drops)))

    # ------------------------------------------------------------------- preemption

    def victims(self, state: EngineState) -> list[int]:
        """Running rows in preemption order: lowest priority, then latest arrival (a row
        whose KV is loading is never a victim: a transfer is writing its blocks); under
        ``preemption.latest_entered`` with order "fcfs", the latest to take its row first."""
        t = state.seqs
        if self.config.preemption.latest_entered and self.config.order == "fcfs":
            return t.latest_entered_first(t.schedulable_rows()).tolist()  # type: ignore[no-any-return]

        def key(row: int) -> tuple[int, float, int]:
            seq = t.seq_at(row)
            return (seq.priority, -seq.arrival_time, -seq.seq_id)

        return sorted(t.schedulable_rows().tolist(), key=key)

    def preempt_until(self, state: EngineState, need: int, emit: Emit, spare: Seq | None) -> None:
        """Preempt victims until ``need`` blocks are available (stop once ``spare``, if given,
        has itself been preempted)."""
        running = self.victims(state)
        while state.pool.num_available < need and running:
            if spare is not None and spare.row < 0:
                return
            victim = state.seqs.seq_at(running.pop(0))
            self.preempt(state, victim, emit, "blocks")


def _deduplicate(
    hashes: list[bytes], canonical: list[int | None], blocks: np.ndarray, replaced: np.ndarray
) -> None:
    """Entries whose hash is cached (or staged earlier in the same event) name the cached
    block and the copy it replaces."""
    staged: dict[bytes, int] = {}
    for j, h in enumerate(hashes):
        cached = canonical[j]
        target = cached if cached is not None else staged.setdefault(h, int(blocks[j]))
        if target != blocks[j]:
            replaced[j], blocks[j] = blocks[j], target


def _keep_private(
    t: SequenceTable,
    pool: BlockPool,
    rows: np.ndarray,
    firsts: np.ndarray,
    lasts: np.ndarray,
    entries: tuple[list[bytes], list[int | None], np.ndarray],
    replaced: np.ndarray,
) -> None:
    """Without dedup, each entry keeps its own block: one whose hash is cached elsewhere
    (or indexed earlier in the same event) is a ``PRIVATE_COPY``; one after a private
    copy in its sequence's chain (in this event, or its own block before them not being
    the indexed one) stays unindexed (``UNINDEXED``) and indexes nothing for a later
    entry of the same hash; the others are indexed."""
    hashes, canonical, blocks = entries
    indexed: set[bytes] = set()
    j = 0
    for row, first, last in zip(rows.tolist(), firsts.tolist(), lasts.tolist(), strict=True):
        seq = t.seq_at(row)
        own = t.path_blocks(seq, first - 1, first)[0] if first else 0  # (chain block)
        detached = bool(first) and pool.cached_block(seq.hashes[first - 1]) != own
        for k in range(j, j + last - first):
            cached = canonical[k]
            if (cached is not None and cached != blocks[k]) or hashes[k] in indexed:
                replaced[k] = ev.PRIVATE_COPY
            elif detached:
                replaced[k] = ev.UNINDEXED
            else:
                indexed.add(hashes[k])
            overlap = seq.overlap_at == first + k - j  # (its chain is the cached block)
            detached = detached or (replaced[k] != 0 and not overlap)
        j += last - first
