"""EngineState: the owners, and the fold of every event into them.

``apply(event)`` is the only way state changes. Each handler is a deterministic function of
(state, event): no clock, no randomness, no I/O. The policy reads the state through queries
and changes it only by emitting events that are folded here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.identity import chain_hashes, namespace_root, span_extras
from kvsched.reducers.blocks import BlockPool, BlockPoolError
from kvsched.reducers.checkpoints import Checkpoint, CheckpointTable, partial_key, tail_extra
from kvsched.reducers.sequences import FREE_ROW, Seq, SequenceTable
from kvsched.reducers.transfers import KVLoad as KVLoadT
from kvsched.reducers.transfers import Lease, TransferTable
from kvsched.statemachines import CkptEvent, CkptState, LoadEvent, LoadState, SeqEvent, SeqState


class InvariantError(AssertionError):
    """State that breaks an owner's invariant."""


class ReplayMismatch(RuntimeError):
    """An event that cannot be folded into the current state."""


@attrs.define(slots=True)
class Session:
    session_id: int
    tokens: np.ndarray  # history: every token of the finished turns
    hashes: list[bytes]
    held: np.ndarray  # blocks this session holds a reference on
    active_seq: int = -1
    root: bytes = b""  # the namespace root its hashes chain from (adapter and salt)
    spans: tuple[ev.MultimodalSpan, ...] = ()  # multimodal spans of the history


@attrs.define(slots=True)
class Stats:
    requests_arrived: int = 0
    requests_rejected: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    ckpt_hit_tokens: int = 0  # hybrid: hits restored from a checkpoint
    kv_only_hit_tokens: int = 0  # hybrid: cached KV unusable for lack of a checkpoint
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    external_hit_tokens: int = 0  # prompt tokens admitted to be loaded from the store


@attrs.define(slots=True)
class Pending:
    """Work scheduled this step, awaiting the executor's outcome (row order = plan order)."""

    step: int = 0
    rows: list[np.ndarray] = attrs.field(factory=list)
    starts: list[np.ndarray] = attrs.field(factory=list)
    ends: list[np.ndarray] = attrs.field(factory=list)

    def add(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.rows.append(rows)
        self.starts.append(starts)
        self.ends.append(ends)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.rows:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(self.rows), np.concatenate(self.starts), np.concatenate(self.ends)


@attrs.define(slots=True)
class StepExtras:
    """Copies a step's plan carries besides the forward (hybrid models), in decision order."""

    state_zero: list[int] = attrs.field(factory=list)
    state_restore: list[tuple[int, int]] = attrs.field(factory=list)
    state_save: list[tuple[int, int]] = attrs.field(factory=list)
    copy_after: list[tuple[int, int]] = attrs.field(factory=list)
    # (row, block index, frozen block): copy the frozen block into the row's private block
    restore_blocks: list[tuple[int, int, int]] = attrs.field(factory=list)
    reserved: list[int] = attrs.field(factory=list)  # checkpoints to publish after the step


def _segments(counts: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts)))


class EngineState:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        max_blocks = -(-config.model.max_context // config.block_size) + 1
        self.pool = BlockPool(config.num_blocks)
        self.hybrid = config.hybrid
        budget = config.checkpoint_budget if config.hybrid else 0
        self.ckpts = CheckpointTable(config.max_batch, budget)
        self.extras = StepExtras()
        self.awaiting_publish: list[int] = []  # checkpoints reserved by the step being executed
        self.failed_seq_ids: list[int] = []  # sequences of the latest failed step
        self.seqs = SequenceTable(config.max_batch, max_blocks, config.block_size)
        self.sessions: dict[int, Session] = {}
        self.transfers = TransferTable()
        self.stats = Stats()
        self.pending = Pending()
        self.step = 0
        self.clock = 0.0
        self.sleeping = False
        self.step_hit_tokens = 0  # prefix-hit statistics of the current step's admissions
        self.step_query_tokens = 0
        self.decode_turns = 0  # consecutive decode-only steps (alternate turn mode)
        self._roots: dict[tuple[str, str], bytes] = {}
        self._handlers: dict[type, Callable[[Any], None]] = {
            ev.RequestArrived: self._on_arrived,
            ev.StepExecuted: self._on_executed,
            ev.StepFailed: self._on_step_failed,
            ev.StepStarted: self._on_step_started,
            ev.RequestRejected: self._on_rejected,
            ev.SequenceAdmitted: self._on_admitted,
            ev.PrefixMatched: self._on_matched,
            ev.BlocksAllocated: self._on_allocated,
            ev.BlocksFreed: self._on_freed,
            ev.SessionBlocksHeld: self._on_session_held,
            ev.PrefillScheduled: self._on_prefill,
            ev.DecodeScheduled: self._on_decode,
            ev.SequencePreempted: self._on_preempted,
            ev.SequenceFinished: self._on_finished,
            ev.SequenceAborted: self._on_aborted,
            ev.SessionClosed: self._on_session_closed,
            ev.Drained: self._on_drained,
            ev.Woken: self._on_woken,
            ev.CheckpointReserved: self._on_ckpt_reserved,
            ev.CheckpointPublished: self._on_ckpt_published,
            ev.CheckpointPinned: self._on_ckpt_pinned,
            ev.CheckpointUnpinned: self._on_ckpt_unpinned,
            ev.CheckpointReleased: self._on_ckpt_released,
            ev.CheckpointEvicted: self._on_ckpt_evicted,
            ev.KVLookupStarted: self._on_lookup_started,
            ev.KVLookupAnswered: self._on_lookup_answered,
            ev.KVLoadCancelled: self._on_load_cancelled,
            ev.KVLoadAdmitted: self._on_load_admitted,
            ev.KVLoadStarted: self._on_load_started,
            ev.KVLoadFinished: self._on_load_finished,
            ev.KVLoadFailed: self._on_load_failed,
            ev.KVSaveStarted: self._on_save_started,
            ev.KVSaveFinished: self._on_save_finished,
            ev.AbortDeferred: self._on_abort_deferred,
            ev.DrainDeferred: self._on_drain_deferred,
        }
        self._ignored = (ev.RequestAborted, ev.SessionEnded, ev.DrainRequested, ev.WakeRequested)

    # ------------------------------------------------------------------------- fold

    def apply(self, event: ev.Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)
        elif not isinstance(event, self._ignored):
            raise ReplayMismatch(f"no reducer for {type(event).__name__}")

    # ------------------------------------------------------------------------- queries

    def root_for(self, adapter: str, salt: str) -> bytes:
        key = (adapter, salt)
        root = self._roots.get(key)
        if root is None:
            root = namespace_root(self.config.model, self.block_size, adapter, salt)
            self._roots[key] = root
        return root

    def seq(self, seq_id: int) -> Seq:
        return self.seqs.seqs[seq_id]

    def holders(self) -> list[np.ndarray]:
        t = self.seqs
        held = []
        for row in t.running_rows().tolist():
            seq = t.objs[row]
            assert seq is not None
            held.append(t.blocks_of(row)[seq.n_pinned :])
        held.extend(s.held for s in self.sessions.values() if len(s.held))
        held.extend(self.ckpts.holders())
        held.extend(self.transfers.lease_holders())
        return held

    # ------------------------------------------------------------------ input folds

    def _on_arrived(self, e: ev.RequestArrived) -> None:
        bs = self.block_size
        prompt = np.asarray(e.prompt, dtype=np.int32)
        session = self.sessions.get(e.session_id) if e.session_id >= 0 else None
        if e.session_id >= 0 and session is None:
            session = Session(e.session_id, np.zeros(0, np.int32), [], np.zeros(0, np.int32))
            self.sessions[e.session_id] = session
        history = session.tokens if session is not None else np.zeros(0, np.int32)
        tokens = np.concatenate([history, prompt]).astype(np.int32)
        root = self.root_for(e.adapter, e.cache_salt)
        # A turn's spans are given in its own prompt; the history keeps the earlier turns'.
        offset = len(history)
        spans = (session.spans if session is not None else ()) + tuple(
            ev.MultimodalSpan(s.start + offset, s.end + offset, s.content_hash)
            for s in e.mm_spans
        )
        # The history's full blocks keep their hashes if the namespace is unchanged (new spans
        # lie past the history, so they cannot change those blocks).
        same_root = session is not None and session.root == root
        keep = len(history) // bs if same_root else 0
        hashes = session.hashes[:keep] if session is not None and same_root else []
        parent = hashes[-1] if hashes else root
        extras = span_extras(spans, bs, keep, len(tokens) // bs) if spans else None
        hashes = hashes + chain_hashes(parent, tokens[keep * bs :], bs, keep, extras)
        seq = Seq(
            seq_id=e.seq_id,
            tokens=tokens,
            n_tokens=len(tokens),
            n_prompt=len(tokens),
            max_tokens=e.max_tokens,
            arrival_time=e.arrival_time,
            priority=e.priority,
            session_id=e.session_id,
            adapter=e.adapter,
            cache_salt=e.cache_salt,
            eos_token_id=e.eos_token_id,
            want_experts=e.return_routed_experts,
            temperature=e.temperature,
            seed=e.seed,
            mm_spans=spans,
            root=root,
            hashes=hashes,
        )
        self.seqs.add(seq)
        if session is not None:
            session.active_seq = e.seq_id
        self.stats.requests_arrived += 1

    def _on_executed(self, e: ev.StepExecuted) -> None:
        if e.step != self.pending.step:
            raise ReplayMismatch(f"outcome of step {e.step}, but step {self.pending.step} ran")
        rows, starts, ends = self.pending.arrays()
        self.pending = Pending()
        table = self.seqs
        if len(e.routed_experts) and len(rows):
            self._record_experts(rows, starts, ends, e.routed_experts)
        if len(rows):
            table.computed[rows] = ends
            self._register_computed(rows)
            for row in rows[table.failures[rows] > 0].tolist():  # a success resets the count
                seq = table.objs[row]
                assert seq is not None
                seq.num_failures = 0
                table.failures[row] = 0
        if len(e.seq_ids):
            self._append_sampled(table.rows_of(e.seq_ids), e.tokens)
        self.stats.generated_tokens += len(e.seq_ids)

    def _record_experts(
        self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, flat: np.ndarray
    ) -> None:
        k = self.config.model.routed_experts_per_token
        ids = flat.reshape(-1, k)
        if len(ids) != int((ends - starts).sum()):
            raise ReplayMismatch("routed experts do not cover the step's tokens")
        offset = 0
        for row, start, end in zip(rows.tolist(), starts.tolist(), ends.tolist(), strict=True):
            seq = self.seqs.objs[row]
            assert seq is not None
            seq.record_experts(start, ids[offset : offset + end - start])
            offset += end - start

    def _append_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Append each row's sampled token (vectorised, into the row's tail buffer); flush and
        hash the blocks that the tokens filled."""
        table, bs = self.seqs, self.block_size
        table.tail[rows, table.ntokens[rows] % bs] = tokens
        table.ntokens[rows] += 1
        table.last_token[rows] = tokens
        for row in rows[table.ntokens[rows] % bs == 0].tolist():
            seq = table.flush(row)
            start = seq.n_tokens - bs
            parent = seq.hashes[-1] if seq.hashes else seq.root
            seq.hashes.extend(chain_hashes(parent, seq.tokens[start : seq.n_tokens], bs))

    def _register_computed(self, rows: np.ndarray) -> None:
        """Give identity to blocks that became full and computed; deduplicate copies."""
        table = self.seqs
        bs = self.block_size
        full = table.computed[rows] // bs
        grown = rows[full > table.registered[rows]]
        for row in grown.tolist():
            seq = table.objs[row]
            assert seq is not None
            first, last = int(table.registered[row]), int(table.computed[row] // self.block_size)
            seq.ensure_path(last)
            for i in range(first, last):
                block = int(table.table[row, i])
                parent = seq.hashes[i - 1] if i else None
                seq.path[i] = block
                canonical = self.pool.register(block, seq.hashes[i], parent, seq.path, i)
                seq.path[i] = canonical
                if seq.n_experts >= (i + 1) * bs and canonical not in self.pool.experts:
                    assert seq.experts is not None
                    self.pool.experts[canonical] = seq.experts[i * bs : (i + 1) * bs].copy()
                if canonical != block:
                    swap = np.asarray([canonical], dtype=np.int32)
                    self.pool.attach(swap)
                    self.pool.release(np.asarray([block], dtype=np.int32))
                    table.table[row, i] = canonical
            table.registered[row] = last

    def _on_step_failed(self, e: ev.StepFailed) -> None:
        """The forward raised: none of its effects happened (no KV or state written, no
        token sampled); the sequences it computed count one failure each."""
        if e.step != self.pending.step:
            raise ReplayMismatch(f"failure of step {e.step}, but step {self.pending.step} ran")
        rows, _, _ = self.pending.arrays()
        self.pending = Pending()
        for row in rows.tolist():
            seq = self.seqs.objs[row]
            assert seq is not None
            seq.num_failures += 1
            self.seqs.failures[row] = seq.num_failures
        self.failed_seq_ids = self.seqs.row_seq[rows].tolist()

    # --------------------------------------------------------------- decision folds

    def _on_step_started(self, e: ev.StepStarted) -> None:
        self.awaiting_publish = self.extras.reserved
        self.extras = StepExtras()
        self.step_hit_tokens = 0
        self.step_query_tokens = 0
        self.step = e.step
        self.clock = e.clock
        self.stats.steps += 1

    def _on_rejected(self, e: ev.RequestRejected) -> None:
        self.stats.requests_rejected += 1

    def _on_admitted(self, e: ev.SequenceAdmitted) -> None:
        self.seqs.activate(self.seq(e.seq_id), e.row)
        if self.hybrid:
            self.extras.state_zero.append(CheckpointTable.runtime_slot(e.row))

    def _on_matched(self, e: ev.PrefixMatched) -> None:
        seq = self.seq(e.seq_id)
        row, k = seq.row, len(e.blocks)
        if row == FREE_ROW or self.seqs.nblocks[row]:
            raise ReplayMismatch(f"sequence {e.seq_id}: prefix match outside admission")
        if e.ckpt_id >= 0:
            if seq.pinned_ckpt != e.ckpt_id:
                raise ReplayMismatch(f"sequence {e.seq_id}: prefix of an unpinned checkpoint")
            seq.n_pinned = k  # covered by the checkpoint's references
        else:
            self.pool.attach(e.blocks)
        t = self.seqs
        t.table[row, :k] = e.blocks
        # The matched (read-only, shared) prefix becomes this sequence's path; the first
        # registration past it grows the path into a private copy.
        seq.path = e.blocks
        if seq.want_experts and k:
            seq.n_experts = 0
            seq.record_experts(0, np.concatenate([self.pool.experts[b] for b in e.blocks.tolist()]))
        t.nblocks[row] = k
        t.computed[row] = e.num_tokens
        t.registered[row] = k
        t.saved[row] = max(int(t.saved[row]), k)  # matched blocks need no save
        seq.num_hit_tokens = e.num_tokens
        if e.num_query_tokens:  # re-admissions after preemption are not counted
            self.stats.query_tokens += e.num_query_tokens
            self.stats.hit_tokens += e.num_tokens
            if e.ckpt_id >= 0:
                self.stats.ckpt_hit_tokens += e.num_tokens
            if e.kv_hit_tokens > e.num_tokens:
                self.stats.kv_only_hit_tokens += e.kv_hit_tokens - e.num_tokens
            self.step_query_tokens += e.num_query_tokens
            self.step_hit_tokens += e.num_tokens

    def _on_allocated(self, e: ev.BlocksAllocated) -> None:
        blocks = self.pool.allocate(len(e.blocks))
        if not np.array_equal(blocks, e.blocks):
            raise ReplayMismatch(f"allocation gave {blocks.tolist()}, event says {e.blocks}")
        t = self.seqs
        bounds = _segments(e.counts)
        for i, seq_id in enumerate(e.seq_ids.tolist()):
            row = self.seq(seq_id).row
            n, k = int(t.nblocks[row]), int(e.counts[i])
            t.table[row, n : n + k] = blocks[bounds[i] : bounds[i + 1]]
            t.nblocks[row] = n + k
            if t.loading[row]:
                load = self.transfers.loads[seq_id]
                load.transition(LoadEvent.allocate)

    def _on_freed(self, e: ev.BlocksFreed) -> None:
        bounds = _segments(e.counts)
        for i, holder in enumerate(e.seq_ids.tolist()):
            blocks = e.blocks[bounds[i] : bounds[i + 1]]
            if holder < 0:
                session = self.sessions[-holder - 1]
                if not np.array_equal(session.held, blocks):
                    raise ReplayMismatch(f"session {-holder - 1} does not hold {blocks}")
                session.held = np.zeros(0, np.int32)
            else:
                self._drop_tail(self.seq(holder), blocks)
            self.pool.release(blocks)

    def _drop_tail(self, seq: Seq, blocks: np.ndarray) -> None:
        t, row = self.seqs, seq.row
        n, k = int(t.nblocks[row]), len(blocks)
        if k > n or not np.array_equal(t.table[row, n - k : n], blocks):
            raise ReplayMismatch(f"sequence {seq.seq_id} does not hold {blocks} at its tail")
        t.set_nblocks(row, n - k)
        t.registered[row] = min(int(t.registered[row]), n - k)
        t.computed[row] = min(int(t.computed[row]), (n - k) * self.block_size)

    def _on_session_held(self, e: ev.SessionBlocksHeld) -> None:
        session = self.sessions[e.session_id]
        if len(session.held):
            raise ReplayMismatch(f"session {e.session_id} already holds blocks")
        seq = self.seq(e.seq_id)
        t, row, k = self.seqs, seq.row, len(e.blocks)
        n = int(t.nblocks[row])
        if not np.array_equal(t.table[row, :k], e.blocks):
            raise ReplayMismatch(f"sequence {e.seq_id} does not hold {e.blocks} at its head")
        t.table[row, : n - k] = t.table[row, k:n].copy()
        t.set_nblocks(row, n - k)
        t.registered[row] = max(0, int(t.registered[row]) - k)
        session.held = np.array(e.blocks, dtype=np.int32)

    def _pending_rows(self, seq_ids: np.ndarray) -> np.ndarray:
        try:
            return self.seqs.rows_of(seq_ids)
        except KeyError as exc:
            raise ReplayMismatch(f"work scheduled for {exc.args[0]}") from exc

    def _on_prefill(self, e: ev.PrefillScheduled) -> None:
        rows = self._pending_rows(e.seq_ids)
        self.pending.step = self.step
        self.pending.add(rows, e.starts, e.ends)
        self.stats.prefill_tokens += int((e.ends - e.starts).sum())
        self.decode_turns = 0

    def _on_decode(self, e: ev.DecodeScheduled) -> None:
        rows = self._pending_rows(e.seq_ids)
        starts = self.seqs.computed[rows]
        self.pending.step = self.step
        self.pending.add(rows, starts, starts + 1)
        self.stats.decode_tokens += len(rows)
        self.decode_turns += 1

    def _release_row(self, seq: Seq) -> None:
        if self.seqs.nblocks[seq.row]:
            raise ReplayMismatch(f"sequence {seq.seq_id} left running with blocks held")
        self.seqs.deactivate(seq)

    def _on_preempted(self, e: ev.SequencePreempted) -> None:
        seq = self.seq(e.seq_id)
        seq.transition(SeqEvent.preempt)
        self._release_row(seq)
        self.transfers.forget(seq.seq_id, keep_failed=True)
        self.seqs.requeue(seq)
        seq.num_preemptions += 1
        seq.preempted_at = self.step
        self.stats.preemptions += 1

    def _on_finished(self, e: ev.SequenceFinished) -> None:
        for seq_id, reason in zip(e.seq_ids.tolist(), e.reasons, strict=True):
            seq = self.seq(seq_id)
            seq.transition(SeqEvent.finish)
            seq.finish_reason = reason
            self._release_row(seq)
            self._end_turn(seq)
            self.transfers.forget(seq_id)
            self.seqs.retire(seq)
            self.stats.requests_finished += 1

    def _end_turn(self, seq: Seq) -> None:
        session = self.sessions.get(seq.session_id) if seq.session_id >= 0 else None
        if session is None:
            return
        session.tokens = seq.token_view().copy()
        session.hashes = seq.hashes
        session.root = seq.root
        session.spans = seq.mm_spans
        session.active_seq = -1

    def _on_aborted(self, e: ev.SequenceAborted) -> None:
        seq = self.seq(e.seq_id)
        if seq.state == SeqState.RUNNING:
            self._release_row(seq)
        seq.transition(SeqEvent.abort)
        if seq.seq_id in self.transfers.loads:
            load = self.transfers.loads[seq.seq_id]
            if load.in_flight or load.open:
                raise ReplayMismatch(f"sequence {e.seq_id} aborted with its load {load.state.name}")
            self.transfers.forget(seq.seq_id)
        seq.finish_reason = e.reason
        session = self.sessions.get(seq.session_id)
        if session is not None:
            session.active_seq = -1
        self.seqs.retire(seq)
        self.stats.requests_aborted += 1

    def _on_session_closed(self, e: ev.SessionClosed) -> None:
        session = self.sessions.pop(e.session_id)
        if len(session.held) or session.active_seq >= 0:
            raise ReplayMismatch(f"session {e.session_id} closed while holding resources")

    def _on_drained(self, e: ev.Drained) -> None:
        if self.seqs.num_running or any(len(s.held) for s in self.sessions.values()):
            raise ReplayMismatch("drained while blocks are still held")
        if self.transfers.busy:
            raise ReplayMismatch("drained while KV transfers are in flight")
        self.pool.clear_cache()
        self.sleeping = True
        self.transfers.drain_pending = False

    def _on_woken(self, e: ev.Woken) -> None:
        self.sleeping = False
        self.transfers.drain_pending = False  # a wake before a deferred drain cancels it

    # ------------------------------------------------------------------ external KV

    def _load(self, seq_id: int) -> KVLoadT:
        load = self.transfers.loads.get(seq_id)
        if load is None:
            raise ReplayMismatch(f"sequence {seq_id} has no KV load")
        return load

    def _on_lookup_started(self, e: ev.KVLookupStarted) -> None:
        if self.seq(e.seq_id).state != SeqState.WAITING:
            raise ReplayMismatch(f"lookup for sequence {e.seq_id}, which is not waiting")
        self.transfers.start_lookup(e.seq_id, e.first_block, e.num_blocks, e.with_state)

    def _on_lookup_answered(self, e: ev.KVLookupAnswered) -> None:
        """An input: a stale answer (its lookup was cancelled meanwhile) is ignored."""
        load = self.transfers.loads.get(e.seq_id)
        if load is None or load.state != LoadState.LOOKUP_PENDING or e.pending:
            return
        if e.num_blocks > load.first_block:
            load.num_blocks = min(e.num_blocks, load.num_blocks)
            load.transition(LoadEvent.lookup_hit)
        else:
            load.transition(LoadEvent.lookup_miss)

    def _on_load_cancelled(self, e: ev.KVLoadCancelled) -> None:
        load = self._load(e.seq_id)
        load.transition(LoadEvent.cancel)
        del self.transfers.loads[e.seq_id]  # a waiting sequence may look up again later

    def _on_load_admitted(self, e: ev.KVLoadAdmitted) -> None:
        load = self._load(e.seq_id)
        load.transition(LoadEvent.admit)
        load.first_block, load.num_blocks = e.first_block, e.num_blocks
        seq = self.seq(e.seq_id)
        self.seqs.activate(seq, e.row, SeqEvent.begin_load)
        self.seqs.saved[e.row] = e.num_blocks  # the store has them
        if self.hybrid:
            self.extras.state_zero.append(CheckpointTable.runtime_slot(e.row))
        self.stats.external_hit_tokens += (e.num_blocks - e.first_block) * self.block_size

    def _on_load_started(self, e: ev.KVLoadStarted) -> None:
        load = self._load(e.seq_id)
        row = self.seq(e.seq_id).row
        lo, hi = load.first_block, load.num_blocks
        if e.first_block != lo or not np.array_equal(self.seqs.table[row, lo:hi], e.blocks):
            raise ReplayMismatch(f"sequence {e.seq_id}: load into blocks it does not hold")
        load.transition(LoadEvent.start)
        load.blocks = np.array(e.blocks, dtype=np.int32)

    def _settle(self, seq_id: int, event: LoadEvent, good: int) -> None:
        """The load ended with ``good`` leading blocks usable: the sequence runs from there."""
        load = self._load(seq_id)
        if not load.in_flight:
            raise ReplayMismatch(f"sequence {seq_id}: load outcome without a load in flight")
        load.transition(event)
        seq = self.seq(seq_id)
        seq.transition(SeqEvent.load_done if event == LoadEvent.finish else SeqEvent.load_failed)
        row = seq.row
        self.seqs.loading[row] = False
        self.seqs.computed[row] = (load.first_block + good) * self.block_size
        # Blocks the load could not bring are recomputed, and saved again.
        self.seqs.saved[row] = min(int(self.seqs.saved[row]), load.first_block + good)
        self._register_computed(np.asarray([row]))
        self.transfers.loaded_blocks += good

    def _on_load_finished(self, e: ev.KVLoadFinished) -> None:
        load = self._load(e.seq_id)
        self._settle(e.seq_id, LoadEvent.finish, load.num_blocks - load.first_block)

    def _on_load_failed(self, e: ev.KVLoadFailed) -> None:
        load = self._load(e.seq_id)
        # A hybrid model cannot use blocks without the state at their end: it falls back.
        good = 0 if self.hybrid else max(0, min(e.num_good_blocks, len(load.blocks)))
        load.failure = e.reason
        self._settle(e.seq_id, LoadEvent.fail, good)
        self.transfers.failed_loads += 1

    def _on_abort_deferred(self, e: ev.AbortDeferred) -> None:
        load = self._load(e.seq_id)
        adds_close = e.close_session and not load.close_session
        if not load.in_flight or (load.abort_reason and not adds_close):
            raise ReplayMismatch(f"sequence {e.seq_id}: abort deferred twice or without a load")
        load.abort_reason = load.abort_reason or e.reason
        load.close_session = load.close_session or e.close_session

    def _on_drain_deferred(self, e: ev.DrainDeferred) -> None:
        self.transfers.drain_pending = True

    def _on_save_started(self, e: ev.KVSaveStarted) -> None:
        seq = self.seq(e.seq_id)
        row, hi = seq.row, e.first_block + len(e.blocks)
        if row == FREE_ROW or hi > self.seqs.registered[row]:
            raise ReplayMismatch(f"save {e.save_id}: blocks of {e.seq_id} are not computed")
        if not np.array_equal(self.seqs.table[row, e.first_block : hi], e.blocks):
            raise ReplayMismatch(f"save {e.save_id}: blocks not held by sequence {e.seq_id}")
        # The lease holds the whole prefix up to the saved blocks, not only them: a cached
        # block must never outlive its parent (the prefix index stays prefix-closed).
        held = self.seqs.table[row, :hi].copy()
        try:
            self.transfers.add_lease(Lease(e.save_id, e.seq_id, held, len(e.blocks), e.ckpt_id))
        except ValueError as exc:
            raise ReplayMismatch(str(exc)) from exc
        self.pool.attach(held)
        if e.ckpt_id >= 0:
            self.ckpts.pin(self.ckpts.get(e.ckpt_id))
        self.seqs.saved[row] = hi

    def _on_save_finished(self, e: ev.KVSaveFinished) -> None:
        lease = self.transfers.end_lease(e.save_id, e.ok)
        if lease is None:
            raise ReplayMismatch(f"save {e.save_id} finished but was never started")
        self.pool.release(lease.blocks)
        if lease.ckpt_id >= 0:
            self.ckpts.unpin(self.ckpts.get(lease.ckpt_id))

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_identity(self, seq: Seq, step: int) -> tuple[bytes, bytes]:
        """(identity, anchor) of the state after ``step`` tokens of ``seq``."""
        bs = self.block_size
        depth = step // bs
        anchor = seq.hashes[depth - 1] if depth else seq.root
        if step % bs == 0:
            return anchor, anchor
        extra = tail_extra(seq.mm_spans, depth * bs, step)
        return partial_key(anchor, seq.tokens[depth * bs : step], extra), anchor

    def reserved_identities(self) -> list[tuple[int, int, bytes]]:
        """(seq id, tokens, identity) of each checkpoint the executed step saved."""
        out = []
        for ckpt_id in self.awaiting_publish:
            c = self.ckpts.get(ckpt_id)
            out.append((c.seq_id, c.step, c.key))
        return out

    def _on_ckpt_reserved(self, e: ev.CheckpointReserved) -> None:
        seq = self.seq(e.seq_id)
        row, bs = seq.row, self.block_size
        key, anchor = self.checkpoint_identity(seq, e.num_tokens)
        frozen = 0
        if e.num_tokens % bs:
            frozen = int(self.pool.allocate(1)[0])
            if frozen != e.frozen_block:
                raise ReplayMismatch(f"frozen block {frozen}, event says {e.frozen_block}")
            partial = int(self.seqs.table[row, e.num_tokens // bs])
            self.extras.copy_after.append((partial, frozen))
        c = Checkpoint(e.ckpt_id, e.seq_id, e.slot, e.num_tokens, key, anchor, frozen)
        self.ckpts.reserve(c)
        self.extras.state_save.append((CheckpointTable.runtime_slot(row), e.slot))
        self.extras.reserved.append(e.ckpt_id)

    def _on_ckpt_published(self, e: ev.CheckpointPublished) -> None:
        c = self.ckpts.get(e.ckpt_id)
        seq = self.seq(c.seq_id)
        depth = c.step // self.block_size
        if self.seqs.registered[seq.row] < depth or self.ckpts.find(c.key) is not None:
            raise ReplayMismatch(f"checkpoint {c.ckpt_id} cannot be published")
        path = seq.path[:depth]
        self.pool.attach(path)
        self.ckpts.publish(c, path)
        self.awaiting_publish.remove(c.ckpt_id)

    def _on_ckpt_pinned(self, e: ev.CheckpointPinned) -> None:
        c = self.ckpts.get(e.ckpt_id)
        seq = self.seq(e.seq_id)
        if seq.pinned_ckpt >= 0 or seq.row == FREE_ROW:
            raise ReplayMismatch(f"sequence {e.seq_id} cannot pin checkpoint {e.ckpt_id}")
        self.ckpts.pin(c)
        seq.pinned_ckpt = c.ckpt_id
        row = seq.row
        self.extras.state_restore.append((c.slot, CheckpointTable.runtime_slot(row)))
        if c.frozen_block:
            self.extras.restore_blocks.append((row, c.step // self.block_size, c.frozen_block))

    def _on_ckpt_unpinned(self, e: ev.CheckpointUnpinned) -> None:
        seq = self.seq(e.seq_id)
        t, row = self.seqs, seq.row
        if seq.pinned_ckpt != e.ckpt_id or t.nblocks[row] != seq.n_pinned:
            raise ReplayMismatch(f"sequence {e.seq_id} cannot unpin checkpoint {e.ckpt_id}")
        self.ckpts.unpin(self.ckpts.get(e.ckpt_id))
        seq.pinned_ckpt, seq.n_pinned = -1, 0
        t.set_nblocks(row, 0)
        t.registered[row] = 0
        t.computed[row] = 0

    def _drop_checkpoint(self, ckpt_id: int, event: CkptEvent) -> None:
        c = self.ckpts.get(ckpt_id)
        if c.state != CkptState.RESERVED:
            self.pool.release(c.path)
        if c.frozen_block:
            self.pool.release(np.asarray([c.frozen_block], dtype=np.int32))
        if ckpt_id in self.awaiting_publish:
            self.awaiting_publish.remove(ckpt_id)
        self.ckpts.remove(c, event)

    def _on_ckpt_released(self, e: ev.CheckpointReleased) -> None:
        c = self.ckpts.get(e.ckpt_id)
        event = CkptEvent.abandon if c.state == CkptState.RESERVED else CkptEvent.release
        self._drop_checkpoint(e.ckpt_id, event)

    def _on_ckpt_evicted(self, e: ev.CheckpointEvicted) -> None:
        self._drop_checkpoint(e.ckpt_id, CkptEvent.evict)

    # -------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Cross-check every owner; raises InvariantError naming the first violation."""
        try:
            self.pool.check_invariants(self.holders())
        except BlockPoolError as exc:
            raise InvariantError(str(exc)) from exc
        self._check_rows()
        pins = self.transfers.lease_pins()
        for seq in self.seqs.seqs.values():
            self._check_seq(seq)
            if seq.pinned_ckpt >= 0:
                pins[seq.pinned_ckpt] = pins.get(seq.pinned_ckpt, 0) + 1
        problem = self.ckpts.check_invariants(pins)
        if problem is not None:
            raise InvariantError(problem)
        for session in self.sessions.values():
            if session.active_seq >= 0 and session.active_seq not in self.seqs.seqs:
                raise InvariantError(f"session {session.session_id} points at a retired seq")
        self._check_transfers()

    def _check_transfers(self) -> None:
        t = self.seqs
        loading = {s.seq_id for s in t.seqs.values() if s.state == SeqState.LOADING_KV}
        rows = {int(t.row_seq[r]) for r in np.nonzero(t.loading)[0].tolist()}
        if rows != loading:
            raise InvariantError(f"loading rows {sorted(rows)} vs loading seqs {sorted(loading)}")
        problem = self.transfers.check_invariants(loading)
        if problem is not None:
            raise InvariantError(problem)
        for seq_id, load in self.transfers.loads.items():
            seq = t.seqs.get(seq_id)
            if seq is None:
                raise InvariantError(f"load record of retired sequence {seq_id}")
            if load.open and seq.state != SeqState.WAITING:
                raise InvariantError(f"open load of {seq_id}, which is {seq.state.name}")

    def _check_rows(self) -> None:
        t = self.seqs
        used = set(t.running_rows().tolist())
        if used & set(t.free_rows) or len(used) + len(t.free_rows) != t.max_batch:
            raise InvariantError("batch rows are not partitioned into used and free")
        for row in used:
            seq = t.seqs.get(int(t.row_seq[row]))
            live = (SeqState.RUNNING, SeqState.LOADING_KV)
            if seq is None or seq.row != row or seq.state not in live:
                raise InvariantError(f"row {row} holds a sequence that is not running there")

    def _check_seq(self, seq: Seq) -> None:
        t, bs = self.seqs, self.block_size
        n_tokens = int(t.ntokens[seq.row]) if seq.row != FREE_ROW else seq.n_tokens
        if len(seq.hashes) != n_tokens // bs:
            raise InvariantError(f"sequence {seq.seq_id}: {len(seq.hashes)} hashes")
        if seq.state == SeqState.WAITING:
            if seq.pinned_ckpt >= 0 or seq.n_pinned:
                raise InvariantError(f"waiting sequence {seq.seq_id} pins a checkpoint")
            if seq.row != FREE_ROW or seq.seq_id not in t.waiting:
                raise InvariantError(f"waiting sequence {seq.seq_id} holds a row or is unqueued")
            return
        if seq.state not in (SeqState.RUNNING, SeqState.LOADING_KV):
            raise InvariantError(f"sequence {seq.seq_id} is in state {seq.state.name}")
        row = seq.row
        if seq.seq_id in t.waiting:
            raise InvariantError(f"running sequence {seq.seq_id} is also queued")
        computed, nblocks = int(t.computed[row]), int(t.nblocks[row])
        if not seq.n_tokens <= n_tokens < seq.n_tokens + bs:
            raise InvariantError(f"sequence {seq.seq_id}: token count disagrees with its row")
        if computed > n_tokens or computed > nblocks * bs:
            raise InvariantError(f"sequence {seq.seq_id}: computed {computed} out of range")
        for i in range(int(t.registered[row])):
            block = int(t.table[row, i])
            if self.pool.hash_of[block] != seq.hashes[i]:
                raise InvariantError(f"sequence {seq.seq_id}: block {i} has another identity")
