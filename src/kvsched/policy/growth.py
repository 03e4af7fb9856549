"""Blocks: allocation (with the evictions it needs), caching computed blocks, releases,
session holds, preemption victims and making room.

Every cache change is a decision of its own: an allocation that reuses cached blocks first
emits ``BlocksEvicted`` for them; computed full blocks enter the prefix index through
``BlocksCached`` (a block whose hash is already cached is deduplicated onto the cached copy).
"""

from __future__ import annotations

import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy.common import I32, Emit, arr
from kvsched.reducers.sequences import Seq
from kvsched.reducers.sessions import SessionTable
from kvsched.reducers.state import EngineState

_EMPTY16 = np.zeros(0, dtype=np.int16)


class Growth:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.bs = config.block_size

    # ------------------------------------------------------------------ allocation

    def take_blocks(self, state: EngineState, n: int, emit: Emit) -> np.ndarray:
        """The blocks an allocation of ``n`` takes, after emitting the evictions it needs
        (the caller checked that ``n`` are available)."""
        peek = state.pool.peek_allocate(n)
        assert peek is not None, f"{n} blocks are not available"
        evict, blocks = peek
        if len(evict):
            emit(ev.BlocksEvicted(evict, state.pool.hashes_of(evict)))
        return blocks

    def allocate(
        self, state: EngineState, seq_ids: np.ndarray, counts: np.ndarray, emit: Emit
    ) -> None:
        total = int(counts.sum())
        if total > 0:
            blocks = self.take_blocks(state, total, emit)
            emit(ev.BlocksAllocated(seq_ids, counts.astype(I32), blocks))

    def allocate_one(self, state: EngineState, seq_id: int, need: int, emit: Emit) -> None:
        if need > 0:
            self.allocate(state, arr([seq_id]), arr([need], I32), emit)

    # --------------------------------------------------------------------- caching

    def cache_computed(self, state: EngineState, rows: np.ndarray, emit: Emit) -> None:
        """Give identity to the rows' blocks that became full and computed."""
        t, pool, bs = state.seqs, state.pool, self.bs
        full = t.computed[rows] // bs
        grown = rows[full > t.registered[rows]]
        if not len(grown):
            return
        k = self.config.model.routed_experts_per_token
        staged: dict[bytes, int] = {}
        with_experts: set[int] = set()
        seq_ids, counts, starts, blocks, replaced = [], [], [], [], []
        hashes, parents, marks, experts = [], [], [], []
        for row in grown.tolist():
            seq = t.objs[row]
            assert seq is not None
            first, last = int(t.registered[row]), int(t.computed[row]) // bs
            seq_ids.append(seq.seq_id)
            counts.append(last - first)
            starts.append(first)
            for i in range(first, last):
                h, own = seq.hashes[i], int(t.table[row, i])
                canonical = pool.index.get(h, staged.get(h))
                if canonical is None:
                    staged[h] = canonical = own
                blocks.append(canonical)
                replaced.append(0 if canonical == own else own)
                hashes.append(h)
                parents.append(seq.hashes[i - 1] if i else seq.root)
                if k:
                    mark = self._experts_of(state, seq, i, canonical, with_experts)
                    marks.append(mark is not None)
                    if mark is not None:
                        experts.append(mark)
        emit(
            ev.BlocksCached(
                arr(seq_ids), arr(counts, I32), arr(starts, I32), arr(blocks, I32),
                arr(replaced, I32), b"".join(hashes), b"".join(parents),
                np.asarray(marks, dtype=np.bool_),
                np.concatenate(experts) if experts else _EMPTY16,
            )
        )

    def _experts_of(
        self, state: EngineState, seq: Seq, i: int, canonical: int, done: set[int]
    ) -> np.ndarray | None:
        """The routed-expert ids block ``i`` adds to the cache (None: none to add)."""
        bs = self.bs
        if seq.n_experts < (i + 1) * bs or canonical in state.pool.experts or canonical in done:
            return None
        assert seq.experts is not None
        done.add(canonical)
        return seq.experts[i * bs : (i + 1) * bs].reshape(-1).astype(np.int16)

    # -------------------------------------------------------------------- releases

    def release(
        self, state: EngineState, seqs: list[Seq], emit: Emit, keep_for_session: bool = False
    ) -> None:
        """Drop every block the sequences hold (a session keeps its cached full blocks)."""
        table = state.seqs
        holders: list[int] = []
        counts: list[int] = []
        blocks: list[np.ndarray] = []
        unpins: list[Seq] = []
        for seq in seqs:
            row = seq.row
            held = table.blocks_of(row)[seq.n_pinned :]
            if seq.pinned_ckpt >= 0:
                unpins.append(seq)
            if keep_for_session and not state.hybrid and seq.session_id in state.sessions:
                keep = int(table.registered[row])
                if keep:
                    emit(ev.SessionBlocksHeld(seq.session_id, seq.seq_id, held[:keep].copy()))
                    held = table.blocks_of(row)
            if len(held):
                holders.append(seq.seq_id)
                counts.append(len(held))
                blocks.append(held.copy())
        if holders:
            emit(ev.BlocksFreed(arr(holders), arr(counts, I32), np.concatenate(blocks)))
        for seq in unpins:
            emit(ev.CheckpointUnpinned(seq.pinned_ckpt, seq.seq_id))

    def free_session_hold(self, state: EngineState, session_id: int, emit: Emit) -> None:
        session = state.sessions.get(session_id)
        if session is not None and len(session.held):
            holder = SessionTable.holder_id(session_id)
            emit(ev.BlocksFreed(arr([holder]), arr([len(session.held)], I32), session.held.copy()))

    def preempt(self, state: EngineState, seq: Seq, emit: Emit, reason: str) -> None:
        self.release(state, [seq], emit)
        emit(ev.SequencePreempted(seq.seq_id, reason))

    def reclaim_sessions(
        self, state: EngineState, need: int, emit: Emit, keep: int, hit: np.ndarray | None = None
    ) -> None:
        """Free idle sessions' held blocks (lowest session id first) until ``need`` are
        available (not counting the cached ``hit`` blocks, which an admission attaches)."""
        pool = state.pool
        for session_id in sorted(state.sessions.sessions):
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
        for session_id, session in state.sessions.sessions.items():
            if session_id != keep and len(session.held):
                drops[session.held] += 1  # a holder never holds a block twice
        freed = (drops > 0) & (pool.ref == drops)
        freed[hit] = False  # a hit block set loose is attached again: no gain
        return int(np.count_nonzero(freed))

    # ------------------------------------------------------------------- preemption

    def victims(self, state: EngineState) -> list[int]:
        """Running rows in preemption order: lowest priority, then latest arrival (a row
        whose KV is loading is never a victim: a transfer is writing its blocks)."""
        t = state.seqs

        def key(row: int) -> tuple[int, float, int]:
            seq = t.objs[row]
            assert seq is not None
            return (seq.priority, -seq.arrival_time, -seq.seq_id)

        return sorted(t.schedulable_rows().tolist(), key=key)

    def preempt_until(self, state: EngineState, need: int, emit: Emit, spare: Seq | None) -> None:
        """Preempt victims until ``need`` blocks are available (stop once ``spare``, if given,
        has itself been preempted)."""
        running = self.victims(state)
        while state.pool.num_available < need and running:
            if spare is not None and spare.row < 0:
                return
            victim = state.seqs.objs[running.pop(0)]
            assert victim is not None
            self.preempt(state, victim, emit, "blocks")
