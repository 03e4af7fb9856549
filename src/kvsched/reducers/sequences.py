"""SequenceTable: every live sequence, the waiting queue, and their folds.

It owns each sequence's tokens, hash chain and lifecycle state (``Seq``), the batch rows of
those that hold one (``RowTable``: computed and known tokens), their block tables and MTP
overlap blocks (``BlockTables``, the folds of block events, and ``DraftRows``, speculative
decoding's drafts: both it builds on), and the
work scheduled in the current step. Every fold is
a deterministic function of (table, event); lifecycle changes fire the triggers that
``statemachines/triggers.py`` chooses for the event. It reads, and never writes, the block
pool (a hit's identity and routed-expert ids), the sessions' history (the turn an arrival
continues: ``SessionTable``) and the blocks of loads without a row (``LoadHoldings``, which
a load's row takes over when it is settled); its reference changes are returned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from kvsched.config import ModelSpec
from kvsched.events import types as ev
from kvsched.identity import (
    HashChain,
    block_hash,
    chain_and_max,
    checkpoint_identity,
    namespace_root,
    span_extras,
    tail_extra,
)
from kvsched.reducers.blocks import BlockPool
from kvsched.reducers.errors import RefChange, ReplayMismatch
from kvsched.reducers.holdings import LoadHoldings
from kvsched.reducers.pipeline import PipelinedRows
from kvsched.reducers.seq import FREE_ROW, History, Seq
from kvsched.statemachines import SEQUENCE, fire, fire_many

__all__ = ["FREE_ROW", "Arrival", "History", "Seq", "SequenceTable"]

_NO_ROWS = np.zeros(0, dtype=np.int64)


class Arrival(NamedTuple):
    """What an arrival's fold takes: the sequence it becomes (its tokens with a session's
    history first, its multimodal spans in those tokens' positions, its namespace root and
    the digests of its full blocks), computed by the pure query ``SequenceTable.arrival``,
    which also tells a router what the request would hit (``Engine.probe_prefix``)."""

    seq: Seq
    top: int | None  # the prompt's largest token id (unsigned) if the hashing read it all


class SequenceTable(PipelinedRows):
    def __init__(
        self,
        model: ModelSpec,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        pool: BlockPool,
        identity: str = "kvs128",
        history: Mapping[int, History] | None = None,
        holdings: LoadHoldings | None = None,
        max_drafts: int = 0,
        pipelined: bool = False,
    ) -> None:
        super().__init__(
            max_batch, max_blocks, block_size, model.max_context, max_drafts, pipelined
        )
        self.model = model
        self.identity = identity  # the block identity scheme (config.IDENTITY_SCHEMES)
        self._pool = pool
        # Read, never written: the sessions' history (SessionTable's) and the blocks of loads
        # without a row (LoadHoldings').
        self._history: Mapping[int, History] = {} if history is None else history
        self._holdings = LoadHoldings(max_blocks) if holdings is None else holdings
        self.seqs: dict[int, Seq] = {}
        self.waiting: dict[int, Seq] = {}  # insertion-ordered
        self.failed: list[int] = []  # sequences computed by the latest failed step
        self.num_finished = 0
        self._roots: dict[tuple[str, str], bytes] = {}  # (a cache of namespace_root)

    def folds(self) -> dict[type[ev.Event], Callable[[Any], RefChange | None]]:
        return {
            ev.StepStarted: self._launch if self.pipelined else self._on_step_started,
            ev.RequestArrived: self.arrival_fold,
            ev.StepExecuted: self._on_executed,
            ev.StepFailed: self._on_step_failed,
            ev.SequenceAdmitted: self._on_admitted,
            ev.KVLoadAdmitted: self._on_load_admitted,
            ev.KVLoadSettled: self._on_load_settled,
            ev.PrefixMatched: self._on_matched,
            ev.BlocksAllocated: self._on_allocated,
            ev.BlocksFreed: self._on_freed,
            ev.BlocksCached: self._on_cached,
            ev.SessionBlocksHeld: self._on_session_held,
            ev.PrefillScheduled: self._on_scheduled,
            ev.DecodeScheduled: self._on_scheduled,
            ev.SequencePreempted: self._on_preempted,
            ev.SequenceFinished: self._on_ended,
            ev.SequenceAborted: self._on_ended,
            ev.Drained: self._on_drained,
            ev.CheckpointReserved: self._on_ckpt_reserved,
            ev.CheckpointPinned: self._on_ckpt_pinned,
            ev.CheckpointUnpinned: self._on_ckpt_unpinned,
            ev.KVSaveStarted: self._on_save_started,
        }

    # ------------------------------------------------------------------------- queries

    def identity_at(self, seq: Seq, step: int) -> tuple[bytes, bytes]:
        """(identity, anchor) of the state after ``step`` tokens of ``seq`` (a pure query:
        tokens sampled since the last flush are read from the row's tail, not copied)."""
        tokens = self.tokens_upto(seq, step)
        bs = self.block_size
        return checkpoint_identity(seq.root, seq.hashes, tokens, seq.mm_spans, step, bs)

    # ------------------------------------------------------------------ input folds

    def _on_step_started(self, e: ev.StepStarted) -> None:
        self.step = e.step

    def arrival(self, e: ev.RequestArrived) -> Arrival:
        """The sequence an arrival becomes: its tokens (a session's history first), its
        multimodal spans in those tokens' positions, and the digests of its full blocks
        (a pure query, nothing is kept: the engine
        computes it once for the policy's check, ``Arrival.top``, and hands it to the fold).
        The digests known already are kept: the caller's (``e.block_hashes``), else the
        history's (its namespace unchanged; new spans lie past it, so they cannot change
        those blocks); one kernel call computes the rest (``chain_and_max``). ``top`` is the
        prompt's largest token id (read as unsigned: a negative id is larger than any
        vocabulary) when that call read every prompt token, else None. Each namespace root
        is computed once (``namespace_root``, kept by (adapter, salt))."""
        # The prompt is kept as a read-only view, not copied (an event is an immutable value:
        # its arrays must not change once given to the engine); decoding grows it into a copy.
        prompt = np.asarray(e.prompt, dtype=np.int32).view()
        prompt.flags.writeable = False
        bs = self.block_size
        root = self._roots.get((e.adapter, e.cache_salt))
        if root is None:
            root = namespace_root(self.model, bs, e.adapter, e.cache_salt, self.identity)
            self._roots[(e.adapter, e.cache_salt)] = root
        known = HashChain(e.block_hashes) if e.block_hashes else None
        history = self._history.get(e.session_id) if e.session_id >= 0 else None
        if history is None:
            tokens, offset, spans = prompt, 0, e.mm_spans
        else:
            tokens = np.concatenate([history.tokens, prompt]) if len(history.tokens) else prompt
            # A turn's spans are given in its own prompt; the history keeps the earlier turns'.
            offset, spans = len(history.tokens), history.spans
            if e.mm_spans:
                spans += tuple(
                    ev.MultimodalSpan(s.start + offset, s.end + offset, s.content_hash)
                    for s in e.mm_spans
                )
            if known is None and history.root == root:  # (another namespace: none apply)
                known = history.hashes.prefix(offset // bs)
        keep = len(known) if known is not None else 0
        parent = known.last(root) if known is not None else root
        extras = span_extras(spans, bs, keep, len(tokens) // bs) if spans else None
        rest, top = chain_and_max(
            self.identity, root, parent, tokens[keep * bs :] if keep else tokens, bs, keep, extras
        )
        hashes = known.extended(rest) if known is not None else HashChain(rest)
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
            skip_hit=e.skip_prefix_hit,
            temperature=e.temperature,
            seed=e.seed,
            mm_spans=spans,
            root=root,
            hashes=hashes,
        )
        return Arrival(seq, top if keep * bs <= offset else None)

    def arrival_fold(self, e: ev.RequestArrived, arrival: Arrival | None = None) -> None:
        """The fold of ``RequestArrived``: with its ``arrival`` when the caller computed it
        (``EngineState.apply(e, arrival)``), else computing it."""
        seq = (self.arrival(e) if arrival is None else arrival).seq
        self.seqs[seq.seq_id] = seq
        self.waiting[seq.seq_id] = seq

    def _on_executed(self, e: ev.StepExecuted) -> None:
        """The step's pending work is computed; each sampled token is appended (vectorised,
        into its row's tail buffer), and the blocks the tokens filled are flushed and hashed.
        Speculative decoding: a row that verified drafts appends the tokens it produced
        (``e.counts``), up to its end (eos, ``max_tokens``, the context), and has computed
        every position but its newest token's (the rejected drafts' KV is stale); the drafts
        proposed for the next step replace the ones it had."""
        counts, landed = e.counts, None
        if self.pipelined:  # (the oldest launched step lands: ``PipelinedRows``)
            landed = self.land_outcome(e, self.waiting, self._hash_block)
            sampled, tokens, counts = landed.samplers, landed.tokens, landed.counts
            before = self.ntokens[sampled] if self.max_drafts else _NO_ROWS
            rows = verified = _NO_ROWS
        else:
            rows, starts, ends = self.pending_arrays()
            verified = self._end_verifying() if self.any_verifying else _NO_ROWS
            self.clear_pending()
            self._landed, self._delivered = e.seq_ids, []
            if len(e.routed_experts) and len(rows):
                self._record_experts(rows, starts, ends, e.routed_experts, self.model)
            sampling = rows[ends >= self.ntokens[rows]]
            if len(rows):
                self.computed[rows] = ends
                if self.failures[rows].any():  # a success resets the count
                    self._reset_failures(rows)
            if not len(e.seq_ids):
                return
            # The outcome names the samplers, usually in plan order (then no lookup is
            # needed; the answer is kept for the next ``rows_of(e.seq_ids)``).
            sampled, tokens = self.rows_of(e.seq_ids, sampling), e.tokens
        if counts is not None and len(counts) and int(counts.max()) > 1:
            self._append_each(sampled, counts, tokens, self._hash_last_block)
        else:
            self.tail[sampled, self.ntokens[sampled] % self.block_size] = tokens
            self.ntokens[sampled] += 1
            self.last_token[sampled] = tokens
            for row in sampled[self.ntokens[sampled] % self.block_size == 0].tolist():
                self._hash_last_block(row)
        if len(verified):
            self._settle_drafts(verified, bool(len(e.routed_experts)))
        elif landed is not None and self.max_drafts:
            self.settle_landed(sampled, landed.drafts, before)
        if self.max_drafts and not self.pipelined:  # (overlapped: placeholders, at launch)
            self._take_drafts(rows, sampled, e.draft_counts, e.drafts)

    def _hash_last_block(self, row: int) -> None:
        """The row's newest block just filled: flush it and append its digest."""
        self._hash_block(self.flush(row))

    def _hash_block(self, seq: Seq) -> None:
        """The sequence's newest block (its tokens in ``seq.tokens``) gets its digest."""
        bs = self.block_size
        start = seq.n_tokens - bs
        parent = seq.hashes.last(seq.root)
        # A block the prompt's last span reaches into keeps that span's content hash.
        extra = tail_extra(seq.mm_spans, start, seq.n_tokens) if seq.mm_spans else b""
        block = seq.tokens[start : seq.n_tokens]
        seq.hashes.append(block_hash(self.identity, seq.root, parent, block, extra))

    def _on_step_failed(self, e: ev.StepFailed) -> None:
        """The forward raised: none of its effects happened (no KV or state written, no
        token sampled); the sequences it computed count one failure each (overlapped steps:
        and the step launched after it is voided, its sequences failed with it)."""
        rows, later = self.fail_in_flight() if self.pipelined else (self._pending_rows, _NO_ROWS)
        self.clear_pending()
        self._drop_drafts(rows)  # (a retry decodes without them)
        for row in rows.tolist():
            seq = self.objs[row]
            assert seq is not None
            seq.num_failures += 1
            self.failures[row] = seq.num_failures
        self.failed = list(dict.fromkeys(self.row_seq[np.concatenate((rows, later))].tolist()))

    # --------------------------------------------------------------- admission folds

    def _on_admitted(self, e: ev.SequenceAdmitted) -> None:
        seq = self.seq(e.seq_id)
        seq.num_hit_tokens = 0  # (until this admission's PrefixMatched, if any)
        self.activate(seq, e.row, e)
        self.waiting.pop(e.seq_id, None)

    def _on_load_admitted(self, e: ev.KVLoadAdmitted) -> None:
        seq = self.seq(e.seq_id)
        if e.row == FREE_ROW:  # no batch row: it holds only what it loads (LoadHoldings)
            seq.state = fire(SEQUENCE, e, seq.seq_id, seq.state)
        else:
            self.activate(seq, e.row, e)
            self.saved[e.row] = e.num_blocks  # the store has them
        self.waiting.pop(e.seq_id, None)

    def _on_load_settled(self, e: ev.KVLoadSettled) -> None:
        seq = self.seq(e.seq_id)
        row = seq.row
        if row == FREE_ROW:
            self._settle_into_row(seq, e)
            return
        if e.row != FREE_ROW or e.num_blocks > self.nblocks[row]:
            raise ReplayMismatch(f"sequence {e.seq_id}: load settled beyond its blocks")
        seq.state = fire(SEQUENCE, e, seq.seq_id, seq.state)
        self.row_state[row] = seq.state
        self.loading[row] = False
        if seq.num_preemptions == 0:  # what the store brought past the local prefix
            seq.cached_external = max(0, e.num_blocks * self.block_size - int(self.computed[row]))
        self.computed[row] = e.num_blocks * self.block_size
        # Blocks the load could not bring are recomputed, and saved again.
        self.saved[row] = min(int(self.saved[row]), e.num_blocks)

    def _settle_into_row(self, seq: Seq, e: ev.KVLoadSettled) -> None:
        """A load without a row is admitted: it takes row ``e.row`` with the blocks it holds
        (``LoadHoldings``, which forgets them after this fold) and runs from its first
        ``e.num_blocks`` (the rest are recomputed in place)."""
        holdings = self._holdings
        held, cached = holdings.blocks_of(seq.seq_id), holdings.cached_of(seq.seq_id)
        rowless = holdings.is_rowless(seq.seq_id)
        if not rowless or e.row == FREE_ROW or not cached <= e.num_blocks <= len(held):
            raise ReplayMismatch(f"sequence {e.seq_id}: load settled beyond its blocks")
        self.activate(seq, e.row, e)
        if seq.num_preemptions == 0:  # what the store brought past the local prefix
            seq.cached_external = (e.num_blocks - cached) * self.block_size
        row, n = e.row, len(held)
        self.table[row, :n] = held
        self.nblocks[row] = n
        self.registered[row] = cached
        self.computed[row] = e.num_blocks * self.block_size
        self.saved[row] = e.num_blocks  # the store has them (or the local cache had them)

    # ------------------------------------------------------------- scheduling folds

    def _on_scheduled(self, e: ev.PrefillScheduled | ev.DecodeScheduled) -> None:
        """Each sequence's prefill chunk, or its decode (of its newest token), joins the
        step's pending work (after any scheduled before it, in plan order). The work starts at
        the row's computed tokens and ends within its known tokens and its blocks."""
        rows = self.rows_of(e.seq_ids)
        self.row_state[rows] = fire_many(SEQUENCE, e, self.row_seq[rows], self.row_state[rows])
        if isinstance(e, ev.DecodeScheduled):
            starts = self.computed[rows]
            ends = starts + 1
            if np.any(ends != self.planned_known(rows)):
                raise ReplayMismatch("a decode of a sequence that is not decoding")
            if e.num_drafts is not None:
                ends = ends + self._schedule_drafts(rows, e.num_drafts)
        else:
            starts, ends = e.starts, e.ends
            if not np.array_equal(starts, self.computed[rows]) or np.any(ends <= starts):
                raise ReplayMismatch("a prefill does not start at its computed tokens")
            if np.any(ends > self.ntokens[rows]):
                raise ReplayMismatch("a prefill runs past its tokens")
        if np.any(ends > self.nblocks[rows] * self.block_size):
            raise ReplayMismatch("work scheduled past its blocks")
        if self.has_pending:
            rows = np.concatenate((self._pending_rows, rows))
            starts = np.concatenate((self._pending_starts, starts))
            ends = np.concatenate((self._pending_ends, ends))
        self._pending_rows, self._pending_starts, self._pending_ends = rows, starts, ends
        self.has_pending, self.pending_step = True, self.step

    # -------------------------------------------------------------------- endings

    def _on_preempted(self, e: ev.SequencePreempted) -> None:
        seq = self.seq(e.seq_id)
        seq.state = fire(SEQUENCE, e, seq.seq_id, seq.state)
        self.deactivate(seq)
        self.waiting[seq.seq_id] = seq
        seq.num_preemptions += 1
        seq.preempted_at = self.step

    def _on_ended(self, e: ev.SequenceFinished | ev.SequenceAborted) -> None:
        """Each sequence ends, for its reason: the cached-token counts the event reports (if
        any) must be its own; it leaves its row (``deactivate``) and the table (its history
        stays in the event log)."""
        counts: list[tuple[int, ...]] | None = None
        if isinstance(e, ev.SequenceAborted):
            ended = [(e.seq_id, e.reason)]
            reported = (e.cached_local, e.cached_checkpoint, e.cached_external)
            if any(reported):
                counts = [reported]
        else:
            ended = list(zip(e.seq_ids.tolist(), e.reasons, strict=True))
            arrays = (e.cached_local, e.cached_checkpoint, e.cached_external)
            if any(len(c) for c in arrays):
                if any(len(c) != len(e.seq_ids) for c in arrays):
                    raise ReplayMismatch("cached-token counts for another number of sequences")
                counts = list(zip(*(c.tolist() for c in arrays), strict=True))
        for i, (seq_id, reason) in enumerate(ended):
            seq = self.seq(seq_id)
            if counts is not None and seq.cached_tokens != counts[i]:
                raise ReplayMismatch(f"sequence {seq_id}: cached-token counts not its own")
            seq.state = fire(SEQUENCE, e, seq_id, seq.state)
            seq.finish_reason = reason
            self.deactivate(seq)
            self.waiting.pop(seq_id, None)
            del self.seqs[seq_id]
            self.num_finished += 1

    def _on_drained(self, e: ev.Drained) -> None:
        if self.num_running:
            raise ReplayMismatch("drained while sequences are running")

    # ---------------------------------------------------------- checkpoints, saves

    def _on_ckpt_reserved(self, e: ev.CheckpointReserved) -> None:
        seq = self.seq(e.seq_id)
        if seq.row == FREE_ROW or (e.key, e.anchor) != self.identity_at(seq, e.num_tokens):
            raise ReplayMismatch(f"checkpoint {e.ckpt_id}: not the state of {e.seq_id}")
        if e.phase == "before":
            if e.num_tokens != self.computed[seq.row]:
                raise ReplayMismatch(f"checkpoint {e.ckpt_id}: not the final state")
            self.has_pending, self.pending_step = True, self.step  # the step's work: the save

    def _on_ckpt_pinned(self, e: ev.CheckpointPinned) -> None:
        seq = self.seq(e.seq_id)
        if seq.pinned_ckpt >= 0 or seq.row == FREE_ROW or self.nblocks[seq.row]:
            raise ReplayMismatch(f"sequence {e.seq_id} cannot pin checkpoint {e.ckpt_id}")
        seq.pinned_ckpt = e.ckpt_id

    def _on_ckpt_unpinned(self, e: ev.CheckpointUnpinned) -> None:
        seq = self.seq(e.seq_id)
        row = seq.row
        if seq.pinned_ckpt != e.ckpt_id or row == FREE_ROW or self.nblocks[row] != seq.n_pinned:
            raise ReplayMismatch(f"sequence {e.seq_id} cannot unpin checkpoint {e.ckpt_id}")
        seq.pinned_ckpt, seq.n_pinned = -1, 0
        self.set_nblocks(row, 0)
        self.registered[row] = 0
        self.computed[row] = 0

    def _on_save_started(self, e: ev.KVSaveStarted) -> None:
        row = self.seq(e.seq_id).row
        self.saved[row] = e.first_block + len(e.blocks)

    # --------------------------------------------------------------------- snapshots

    def snapshot(self) -> tuple[object, ...]:
        """Everything the table holds, as plain comparable data."""
        seqs = tuple(
            (
                s.seq_id, s.state, s.row, s.n_tokens, s.token_view().tobytes(), s.hashes.packed(),
                s.pinned_ckpt, s.n_pinned, s.num_failures, s.num_preemptions, s.preempted_at,
                s.num_hit_tokens, s.n_experts, s.cached_tokens, s.overlap_block, s.overlap_at,
            )
            for s in self.seqs.values()
        )
        arrays = tuple(
            a.tobytes()
            for a in (
                self.row_seq, self.row_state, self.computed, self.ntokens, self.nblocks,
                self.registered, self.last_token, self.loading, self.saved, self._consts,
                self.temperature, self.table, self.tail, self.ndrafts, self.draft_ids,
                self.verifying, self.ahead,
            )
        )
        pending = (self.has_pending, *(a.tobytes() for a in self.pending_arrays()))
        return (
            seqs, arrays, tuple(self.free_rows), tuple(self.waiting), pending,
            self.pending_step, tuple(self.failed), self.num_finished, self.step,
        )
