"""The scheduling policy: reads EngineState, decides, and changes it only by emitting events.

``emit`` folds an event into the state at once (so later decisions of the same step see it)
and records it as a decision of the step. A decision that is not emitted leaves no trace: a
tentative prefix match that admission rejects is simply never emitted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import attrs
import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy.ordering import order_waiting
from kvsched.reducers.checkpoints import Checkpoint, CheckpointTable, partial_key, tail_extra
from kvsched.reducers.sequences import Seq
from kvsched.reducers.state import EngineState
from kvsched.statemachines import LoadState, SeqState

Emit = Callable[[ev.Event], None]
I32, I64 = np.int32, np.int64


def _arr(values: list[int], dtype: type = I64) -> np.ndarray:
    return np.asarray(values, dtype=dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@attrs.define(slots=True)
class _StepBudget:
    """What this step has committed so far."""

    busy: bool = False  # decode work is scheduled this step
    tokens: int = 0
    prefills: int = 0
    long_chunks: int = 0
    seq_ids: list[int] = attrs.field(factory=list)
    starts: list[int] = attrs.field(factory=list)
    ends: list[int] = attrs.field(factory=list)

    def add(self, seq_id: int, start: int, end: int, final: bool) -> None:
        self.seq_ids.append(seq_id)
        self.starts.append(start)
        self.ends.append(end)
        self.tokens += end - start
        self.prefills += 1
        self.long_chunks += 0 if final else 1


class Match(NamedTuple):
    """A tentative prefix match: tokens served, their blocks, the checkpoint to restore."""

    num_tokens: int
    blocks: np.ndarray
    ckpt_id: int = -1
    kv_tokens: int = -1  # hybrid: what the KV cache alone matched


NO_MATCH = Match(0, np.zeros(0, dtype=np.int32))


@attrs.frozen
class Chunk:
    start: int
    end: int
    final: bool


class Policy:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.bs = config.block_size
        self._split_tail = config.hybrid and config.external_save

    # ----------------------------------------------------------------------- inputs

    def validate(self, state: EngineState, e: ev.RequestArrived) -> str | None:
        """Why a request must be rejected, or None when it is acceptable."""
        model = self.config.model
        prompt = np.asarray(e.prompt)
        if len(prompt) == 0:
            return "empty prompt"
        if e.max_tokens <= 0:
            return f"max_tokens must be positive, got {e.max_tokens}"
        if e.seq_id in state.seqs.seqs or e.seq_id < 0:
            return f"duplicate or invalid request id {e.seq_id}"
        if prompt.min() < 0 or prompt.max() >= model.vocab_size:
            return f"token id outside the vocabulary [0, {model.vocab_size})"
        history = 0
        session = state.sessions.get(e.session_id) if e.session_id >= 0 else None
        if session is not None:
            if session.active_seq >= 0:
                return f"session {e.session_id} already has a request in flight"
            history = len(session.tokens)
        total = history + len(prompt)
        if total >= model.max_context:
            return f"prompt of {total} tokens exceeds the maximum context {model.max_context}"
        if _cdiv(total + 1, self.bs) > self.config.num_blocks - 1:
            return f"prompt of {total} tokens needs more KV blocks than the cache has"
        longest = min(total + e.max_tokens, model.max_context)
        if _cdiv(longest, self.bs) > self.config.num_blocks - 1:
            # It could never finish alone: it would be preempted and recomputed forever.
            return (
                f"prompt of {total} tokens plus max_tokens {e.max_tokens} needs more KV blocks"
                f" than the cache has ({self.config.num_blocks - 1})"
            )
        for span in e.mm_spans:
            if not 0 <= span.start < span.end <= len(prompt):
                return f"multimodal span [{span.start}, {span.end}) outside the prompt"
        return None

    def finish_finished(self, state: EngineState, outcome: ev.StepExecuted, emit: Emit) -> None:
        """Retire the sequences whose newest token ends them (eos, max_tokens or context)."""
        if not len(outcome.seq_ids):
            return
        t = state.seqs
        rows = t.rows_of(outcome.seq_ids)
        stop = outcome.tokens == t.eos[rows]
        length = (t.ntokens[rows] - t.n_prompt[rows] >= t.max_tokens[rows]) | (
            t.ntokens[rows] >= self.config.model.max_context
        )
        migrate = self.config.role == "prefill"  # the first token ends a prefill-role request
        done = np.nonzero(stop | length | migrate)[0]
        if len(done):
            seqs = [state.seq(int(s)) for s in outcome.seq_ids[done]]
            reasons = tuple(
                "stop" if stop[i] else "length" if length[i] else "migrated"
                for i in done.tolist()
            )
            self._release(state, seqs, emit, keep_for_session=True)
            emit(ev.SequenceFinished(outcome.seq_ids[done].copy(), reasons))

    def abort(
        self, state: EngineState, seq_id: int, reason: str, emit: Emit, close_session: bool = False
    ) -> bool:
        """Abort a sequence; False when the abort is deferred (its KV is loading: it is
        applied, once, when the load settles)."""
        seq = state.seqs.seqs.get(seq_id)
        if seq is None:
            return True  # unknown or already retired: nothing to release
        load = state.transfers.load_of(seq_id)
        if seq.state == SeqState.LOADING_KV:
            assert load is not None
            # A second abort changes nothing, unless it adds the end of the session.
            if not load.abort_reason or (close_session and not load.close_session):
                emit(ev.AbortDeferred(seq_id, load.abort_reason or reason, close_session))
            return False
        if load is not None and load.open:
            emit(ev.KVLoadCancelled(seq_id, reason))
        if seq.state == SeqState.RUNNING:
            self._release(state, [seq], emit)
        emit(ev.SequenceAborted(seq_id, reason))
        return True

    def end_session(self, state: EngineState, session_id: int, emit: Emit) -> None:
        session = state.sessions.get(session_id)
        if session is None:
            return
        active = session.active_seq
        if active >= 0 and not self.abort(state, active, "session ended", emit, True):
            return  # closed once the active turn's load settles
        self._free_session_hold(state, session_id, emit)
        emit(ev.SessionClosed(session_id))

    def settle_load(self, state: EngineState, seq_id: int, emit: Emit) -> None:
        """After a load finished or failed: a hybrid sequence whose load failed recomputes
        from its local prefix (preempted; it will not try the store again); a deferred abort
        or end of session happens now, exactly once."""
        load = state.transfers.load_of(seq_id)
        assert load is not None
        seq = state.seq(seq_id)
        if load.state == LoadState.FAILED and state.hybrid:
            self.preempt(state, seq, emit, f"kv load failed: {load.failure}")
        if load.abort_reason:
            reason, close = load.abort_reason, load.close_session
            session_id = seq.session_id
            self.abort(state, seq_id, reason, emit)
            if close:
                self.end_session(state, session_id, emit)

    def drain(self, state: EngineState, emit: Emit) -> None:
        """Preempt everything running, drop session holds and checkpoints, clear the prefix
        cache (sleep releases the device memory): afterwards nothing is held or cached.

        Lookups are cancelled (they are asked again after waking). Loads and saves in flight
        write or read device memory: the drain waits until they settle (``DrainDeferred``);
        meanwhile nothing is scheduled."""
        for seq_id, load in sorted(state.transfers.loads.items()):
            if load.open:
                emit(ev.KVLoadCancelled(seq_id, "drain"))
        if state.transfers.busy:
            if not state.transfers.drain_pending:
                emit(ev.DrainDeferred())
            return
        running = [state.seq(int(state.seqs.row_seq[r])) for r in state.seqs.running_rows()]
        for seq in running:
            self.preempt(state, seq, emit, reason="drain")
        for session_id in sorted(state.sessions):
            self._free_session_hold(state, session_id, emit)
        for ckpt_id in sorted(state.ckpts.ckpts):
            emit(ev.CheckpointReleased(ckpt_id, "drain"))
        emit(ev.Drained())  # the device memory goes away: the prefix cache is cleared too

    # --------------------------------------------------------------------- releases

    def _release(
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
            emit(ev.BlocksFreed(_arr(holders), _arr(counts, I32), np.concatenate(blocks)))
        for seq in unpins:
            emit(ev.CheckpointUnpinned(seq.pinned_ckpt, seq.seq_id))

    def _free_session_hold(self, state: EngineState, session_id: int, emit: Emit) -> None:
        held = state.sessions[session_id].held
        if len(held):
            emit(ev.BlocksFreed(_arr([-session_id - 1]), _arr([len(held)], I32), held.copy()))

    def preempt(self, state: EngineState, seq: Seq, emit: Emit, reason: str) -> None:
        self._release(state, [seq], emit)
        emit(ev.SequencePreempted(seq.seq_id, reason))

    def _reclaim_sessions(
        self, state: EngineState, need: int, emit: Emit, keep: int, hit: np.ndarray | None = None
    ) -> None:
        """Free idle sessions' held blocks (oldest session first) until ``need`` are available
        (not counting the cached ``hit`` blocks, which an admission attaches rather than takes)."""
        pool = state.pool
        for session_id in sorted(state.sessions):
            unheld = pool.count_unheld(hit) if hit is not None and len(hit) else 0
            if pool.num_available - unheld >= need:
                return
            if session_id != keep:
                self._free_session_hold(state, session_id, emit)

    def _reclaim_gain(self, state: EngineState, keep: int, hit: np.ndarray) -> int:
        """How many blocks freeing every idle session's hold but ``keep``'s would make
        available to an admission attaching ``hit`` (pure query)."""
        pool = state.pool
        drops = np.zeros(pool.num_blocks, dtype=np.int64)
        for session_id, session in state.sessions.items():
            if session_id != keep and len(session.held):
                drops[session.held] += 1  # a holder never holds a block twice
        freed = (drops > 0) & (pool.ref == drops)
        freed[hit] = False  # a hit block set loose is attached again: no gain
        return int(np.count_nonzero(freed))

    def _victim_key(self, state: EngineState, row: int) -> tuple[int, float, int]:
        seq = state.seq(int(state.seqs.row_seq[row]))
        return (seq.priority, -seq.arrival_time, -seq.seq_id)

    def _victims(self, state: EngineState) -> list[int]:
        """Running rows in preemption order: lowest priority, then latest arrival (a row
        whose KV is loading is never a victim: a transfer is writing its blocks)."""
        rows = state.seqs.schedulable_rows().tolist()
        return sorted(rows, key=lambda r: self._victim_key(state, r))

    def _make_room(self, state: EngineState, need_rows: np.ndarray, emit: Emit) -> np.ndarray:
        """Preempt victims until every remaining row in ``need_rows`` can get one block.

        Victims: lowest priority first, then latest arrival; not necessarily a row that needs
        the block. Returns the rows that still need (and can now get) a block.
        """
        self._reclaim_sessions(state, len(need_rows), emit, keep=-1)
        if state.hybrid:
            self._evict_checkpoints_for(state, len(need_rows), emit, keep=-1)
        need = set(need_rows.tolist())
        running = self._victims(state)
        while state.pool.num_available < len(need) and running:
            victim = running.pop(0)
            need.discard(victim)
            self.preempt(state, state.seq(int(state.seqs.row_seq[victim])), emit, "blocks")
        return np.asarray(sorted(need), dtype=np.int64)

    # --------------------------------------------------------------------- schedule

    def schedule(self, state: EngineState, emit: Emit) -> None:
        if state.sleeping:
            return
        if state.transfers.drain_pending:
            if not state.transfers.busy:
                self.drain(state, emit)
            return
        table = state.seqs
        rows = table.schedulable_rows()
        decode_mask = table.computed[rows] == table.ntokens[rows] - 1
        decode_rows, chunk_rows = rows[decode_mask], rows[~decode_mask]
        alternate = self.config.turn_mode == "alternate"
        prefill_turn = self._is_prefill_turn(state, len(decode_rows), len(chunk_rows))
        budget = _StepBudget()
        if len(decode_rows) and not (alternate and prefill_turn):
            budget.busy = self._schedule_decode(state, decode_rows, emit)
        if prefill_turn:
            chunk_rows = chunk_rows[table.row_seq[chunk_rows] >= 0]  # not preempted by decode
            self._schedule_chunks(state, chunk_rows, budget, emit)
            self._admit_waiting(state, budget, emit)
        if budget.seq_ids:
            emit(ev.PrefillScheduled(_arr(budget.seq_ids), _arr(budget.starts), _arr(budget.ends)))
        elif alternate and prefill_turn and len(decode_rows):
            # The prefill turn found nothing it could run: decode rather than idle.
            self._schedule_decode(state, decode_rows[table.row_seq[decode_rows] >= 0], emit)

    def _is_prefill_turn(self, state: EngineState, n_decode: int, n_chunks: int) -> bool:
        if self.config.turn_mode == "mixed" or n_decode == 0:
            return True
        if not state.seqs.waiting and not n_chunks:
            return False
        # Every prefill turn is followed by at least one decode turn, so decoding sequences
        # always progress (otherwise admissions could starve them and thrash preemption).
        if state.decode_turns == 0:
            return False
        half_empty = state.seqs.num_running < 0.5 * self.config.max_batch
        return half_empty or state.decode_turns >= self.config.prefill_interval

    def _schedule_decode(self, state: EngineState, rows: np.ndarray, emit: Emit) -> bool:
        """Grow and schedule the decoding rows; returns whether any decode was scheduled."""
        table = state.seqs
        needing = rows[table.computed[rows] // self.bs >= table.nblocks[rows]]
        if len(needing) > state.pool.num_available:
            needing = self._make_room(state, needing, emit)
            rows = rows[table.row_seq[rows] >= 0]
        if len(needing):
            blocks = state.pool.peek_allocate(len(needing))
            assert blocks is not None
            seq_ids = table.row_seq[needing].copy()
            emit(ev.BlocksAllocated(seq_ids, np.ones(len(needing), I32), blocks))
        if len(rows):
            emit(ev.DecodeScheduled(table.row_seq[rows].copy()))
            interval = self.config.decode_checkpoint_interval
            if state.hybrid and interval:
                saving = rows[(table.computed[rows] + 1) % interval == 0]
                for row in saving.tolist():
                    seq = table.objs[row]
                    assert seq is not None
                    self._reserve_checkpoint(state, seq, int(table.computed[row]) + 1, emit)
        return bool(len(rows))

    def chunk_of(self, seq: Seq, start: int) -> Chunk:
        """The canonical chunk starting at ``start``: it ends at the next multiple of the
        chunk length (a function of the request and the config only) or at the prompt end."""
        size = self.config.chunk_tokens
        end = min(seq.n_tokens, (start // size + 1) * size)
        if self._split_tail and end == seq.n_tokens:
            # Hybrid models saving to the store: end a chunk at the deepest block boundary a
            # lookup of this prompt (or of it plus its first token) can use, so an aligned
            # state checkpoint exists there to be saved.
            cut = (seq.n_tokens - 1) // self.bs * self.bs
            if start < cut < end:
                end = cut
        return Chunk(start, end, end == seq.n_tokens)

    def _fits_budget(self, budget: _StepBudget, chunk: Chunk) -> bool:
        if budget.prefills == 0:
            return True  # the first prefill of a step is always admitted
        return budget.tokens + chunk.end - chunk.start <= self.config.max_prefill_tokens

    def _long_gate_open(self, budget: _StepBudget, chunk: Chunk) -> bool:
        return chunk.final or budget.long_chunks < self.config.max_long_chunks_per_step

    def _schedule_chunks(
        self, state: EngineState, rows: np.ndarray, budget: _StepBudget, emit: Emit
    ) -> None:
        """Continue the chunked prefills of running sequences, oldest first."""
        table = state.seqs
        seqs = sorted((state.seq(int(table.row_seq[r])) for r in rows), key=_arrival_key)
        for seq in seqs:
            if seq.state != SeqState.RUNNING:
                continue  # preempted for an earlier sequence's chunk this step
            chunk = self.chunk_of(seq, int(table.computed[seq.row]))
            if not (self._fits_budget(budget, chunk) and self._long_gate_open(budget, chunk)):
                continue
            need = _cdiv(chunk.end, self.bs) - int(table.nblocks[seq.row])
            if need > state.pool.num_available:
                self._reclaim_sessions(state, need, emit, keep=-1)
            if need > state.pool.num_available and state.hybrid:
                self._evict_checkpoints_for(state, need, emit, keep=-1)
            if need > state.pool.num_available:
                if not budget.busy and budget.prefills == 0:
                    self._preempt_for_chunk(state, seq, need, emit)
                continue
            self._allocate(state, seq.seq_id, need, emit)
            self._add_prefill(state, seq, chunk, budget, emit)

    def _preempt_for_chunk(self, state: EngineState, seq: Seq, need: int, emit: Emit) -> None:
        """Nothing else can progress: preempt the policy's victims (maybe ``seq`` itself)."""
        running = self._victims(state)
        while state.pool.num_available < need and running and seq.row >= 0:
            victim = state.seq(int(state.seqs.row_seq[running.pop(0)]))
            self.preempt(state, victim, emit, "blocks")

    def _allocate(self, state: EngineState, seq_id: int, need: int, emit: Emit) -> None:
        if need > 0:
            blocks = state.pool.peek_allocate(need)
            assert blocks is not None
            emit(ev.BlocksAllocated(_arr([seq_id]), _arr([need], I32), blocks))

    def _admit_waiting(self, state: EngineState, budget: _StepBudget, emit: Emit) -> None:
        table = state.seqs
        if not table.waiting:
            return
        stop_on_failure = self.config.order != "ttft"
        for seq in order_waiting(self.config, list(table.waiting.values()), state.clock):
            if table.num_running >= self.config.max_batch:
                return
            if seq.preempted_at == state.step:
                continue  # preempted to make room this step: not readmitted in the same step
            if self.config.external_load and self._awaits_lookup(state, seq, emit):
                continue  # the store is being asked: skipped until it answers
            verdict = self._try_admit(state, seq, budget, emit)
            if verdict == "stop" and stop_on_failure:
                return

    def find_prefix(self, state: EngineState, seq: Seq) -> Match:
        """Tentative match (a pure query): the longest usable cached prefix.

        A hit never covers the last known token (it is recomputed for the next logits). For a
        hybrid model a prefix is usable only up to the deepest published state checkpoint on
        the request's hash chain: KV without a state is a miss.
        """
        if not self.config.enable_prefix_caching:
            return NO_MATCH
        pool, bs = state.pool, self.bs
        if not state.hybrid:
            depth = pool.find_prefix_len(seq.hashes, (seq.n_tokens - 1) // bs)
            # MTP: the last k cached blocks are recomputed (into private blocks, which
            # registration then swaps for the canonical ones) so a draft head gets hidden states.
            depth = max(0, depth - self.config.num_speculative_tokens)
            blocks = pool.find_blocks(seq.hashes, depth)
            if seq.want_experts:  # a block without routed-expert ids ends the match
                depth = pool.count_with_experts(blocks)
                blocks = blocks[:depth]
            return Match(depth * bs, blocks)
        return self._find_checkpoint(state, seq)

    def _find_checkpoint(self, state: EngineState, seq: Seq) -> Match:
        """The deepest usable checkpoint. With MTP (k speculative tokens), the cached KV must
        reach k blocks beyond the checkpoint's anchor: those blocks are recomputed."""
        limit = seq.n_tokens - 1
        top = limit // self.bs
        k = self.config.num_speculative_tokens
        fast = not k and not seq.want_experts
        hit = self._checkpoint_at(state, seq, top, limit) if fast else None
        kv_depth = top
        if hit is None:
            pool = state.pool
            kv_depth = pool.find_prefix_len(seq.hashes, top)
            deepest = min(kv_depth - k, top - 1 if fast else top)
            if seq.want_experts:  # a block without routed-expert ids ends the match
                covered = pool.count_with_experts(pool.find_blocks(seq.hashes, kv_depth))
                deepest = min(deepest, covered)
            for depth in range(deepest, -1, -1):
                hit = self._checkpoint_at(state, seq, depth, limit)
                if hit is not None:
                    break
        if hit is None:
            return Match(0, NO_MATCH.blocks, -1, kv_depth * self.bs)
        return Match(hit.step, hit.path, hit.ckpt_id, kv_depth * self.bs)

    def _checkpoint_at(
        self, state: EngineState, seq: Seq, depth: int, limit: int
    ) -> Checkpoint | None:
        """The deepest usable checkpoint anchored at block ``depth`` (partial tails first)."""
        ckpts, bs = state.ckpts, self.bs
        anchor = seq.hashes[depth - 1] if depth else seq.root
        tails = ckpts.find_partials(anchor) if not seq.want_experts else {}
        for step in sorted(tails, reverse=True) if tails else ():
            if step <= limit and self._boundary_safe(seq, step):
                extra = tail_extra(seq.mm_spans, depth * bs, step)
                partial = ckpts.find(partial_key(anchor, seq.tokens[depth * bs : step], extra))
                if partial is not None:
                    return partial
        if depth:
            aligned = ckpts.find(anchor)
            if aligned is not None and (not seq.mm_spans or self._boundary_safe(seq, aligned.step)):
                return aligned
        return None

    @staticmethod
    def _boundary_safe(seq: Seq, step: int) -> bool:
        """A checkpoint never sits inside a multimodal span."""
        return all(not span.start < step < span.end for span in seq.mm_spans)

    def attach_prefix(self, state: EngineState, seq: Seq, match: Match, emit: Emit) -> None:
        """Commit a match: take a batch row, pin the checkpoint (hybrid) and attach the cached
        blocks (statistics counted on the first admission only, not after preemption)."""
        first = seq.num_preemptions == 0
        emit(ev.SequenceAdmitted(seq.seq_id, state.seqs.peek_free_row()))
        if match.ckpt_id >= 0:
            emit(ev.CheckpointPinned(match.ckpt_id, seq.seq_id))
        if match.num_tokens or first:
            query = seq.n_prompt if first else 0
            emit(
                ev.PrefixMatched(
                    seq.seq_id, match.blocks, match.num_tokens, query, match.ckpt_id,
                    match.kv_tokens,
                )
            )

    # ------------------------------------------------------------------ external KV

    def _lookup_range(self, state: EngineState, seq: Seq) -> tuple[int, int]:
        """(first, end): the chain blocks the store could add beyond the local match. A hit
        never covers the last known token; for a hybrid model the local part is what a
        checkpoint serves."""
        end = (seq.n_tokens - 1) // self.bs - self.config.num_speculative_tokens
        match = self.find_prefix(state, seq)
        return match.num_tokens // self.bs, end

    def _awaits_lookup(self, state: EngineState, seq: Seq, emit: Emit) -> bool:
        """Start the store lookup of a sequence that has none; True while it is pending."""
        load = state.transfers.load_of(seq.seq_id)
        if load is None:
            if seq.want_experts:
                return False  # the store keeps no routed-expert ids: never loaded
            first, end = self._lookup_range(state, seq)
            if first >= end:
                return False  # the local cache serves every block the store could
            emit(ev.KVLookupStarted(seq.seq_id, first, end, state.hybrid))
            return True
        return load.state == LoadState.LOOKUP_PENDING

    def _external_plan(self, state: EngineState, seq: Seq, match: Match) -> tuple[int, int]:
        """(first, end) of a usable planned load, else (0, 0). The local part is the cached
        KV chain (for a hybrid model the loaded state replaces a local checkpoint); it must
        still reach the block the lookup started from."""
        load = state.transfers.load_of(seq.seq_id)
        if load is None or load.state != LoadState.PLANNED:
            return 0, 0
        end = load.num_blocks
        if end * self.bs <= match.num_tokens:
            return 0, 0  # the local cache now serves as much
        local = state.pool.find_prefix_len(seq.hashes, end)
        if local < load.first_block:
            return 0, 0  # the local part the lookup relied on was evicted meanwhile
        if local >= end and not state.hybrid:
            return 0, 0  # nothing to load (a hybrid model may still load the state at end)
        return local, end

    def _admit_with_load(
        self, state: EngineState, seq: Seq, first: int, end: int, emit: Emit
    ) -> str:
        """Admit a sequence whose chain blocks [first, end) load from the store: it takes a
        row and every block of its prompt now (so concurrent loads never wait on each other
        for their tails) and computes nothing until the load settles."""
        pool = state.pool
        hit = pool.find_blocks(seq.hashes, first)
        need = _cdiv(seq.n_tokens, self.bs) - first
        if not self._make_fit(state, seq, need, hit, -1, emit):
            return "stop"
        emit(ev.KVLoadAdmitted(seq.seq_id, state.seqs.peek_free_row(), first, end))
        first_admission = seq.num_preemptions == 0
        emit(
            ev.PrefixMatched(
                seq.seq_id, hit, first * self.bs, seq.n_prompt if first_admission else 0
            )
        )
        if seq.session_id in state.sessions:
            self._free_session_hold(state, seq.session_id, emit)
        self._allocate(state, seq.seq_id, need, emit)
        row = seq.row
        blocks = state.seqs.table[row, first:end].copy()
        slot = CheckpointTable.runtime_slot(row) if state.hybrid else -1
        emit(ev.KVLoadStarted(seq.seq_id, blocks, first, slot))
        return "admitted"

    def _make_fit(
        self, state: EngineState, seq: Seq, need: int, hit: np.ndarray, keep: int, emit: Emit
    ) -> bool:
        """Make ``need`` blocks available besides the ``hit`` an admission attaches, by
        releasing other sessions' holds or evicting checkpoints only when that makes the
        admission fit (a rejected admission leaves no trace). False: it cannot fit."""
        pool = state.pool
        unheld = pool.count_unheld(hit)
        shortfall = need - (pool.num_available - unheld)
        if shortfall <= 0:
            return True
        if state.hybrid:
            # Unheld hit blocks count as available but are attached, not taken.
            if not self._evict_checkpoints_for(state, need + unheld, emit, keep=keep):
                return False
        elif shortfall > self._reclaim_gain(state, -1, hit):
            return False
        else:
            # Any session's hold may go, the admitted sequence's own too: the admission
            # releases it anyway (after attaching what the hit shares with it).
            self._reclaim_sessions(state, need, emit, -1, hit)
        # (Evicting a checkpoint whose path overlaps an unheld hit gains nothing for it.)
        return need <= pool.num_available - pool.count_unheld(hit)

    def _try_admit(self, state: EngineState, seq: Seq, budget: _StepBudget, emit: Emit) -> str:
        """Admit one waiting sequence, or return why not ('skip' or 'stop') leaving no trace."""
        bs = self.bs
        match = self.find_prefix(state, seq)
        if self.config.external_load:
            first, end = self._external_plan(state, seq, match)
            if end:
                return self._admit_with_load(state, seq, first, end, emit)
        chunk = self.chunk_of(seq, match.num_tokens)
        if not self._long_gate_open(budget, chunk):
            return "skip"
        if not self._fits_budget(budget, chunk):
            return "stop"
        hit = match.blocks
        need = _cdiv(chunk.end, bs) - len(hit)
        if not self._make_fit(state, seq, need, hit, match.ckpt_id, emit):
            return "stop"
        load = state.transfers.load_of(seq.seq_id)
        if load is not None and load.open:
            emit(ev.KVLoadCancelled(seq.seq_id, "served by the local cache"))
        self.attach_prefix(state, seq, match, emit)
        if seq.session_id in state.sessions:
            self._free_session_hold(state, seq.session_id, emit)
        self._allocate(state, seq.seq_id, need, emit)
        self._add_prefill(state, seq, chunk, budget, emit)
        return "admitted"

    # ------------------------------------------------------------------ checkpoints

    def _add_prefill(
        self, state: EngineState, seq: Seq, chunk: Chunk, budget: _StepBudget, emit: Emit
    ) -> None:
        """Schedule a chunk; for a hybrid model, save the state at its end when the end is a
        save point (a block-aligned chunk end, or the prompt end)."""
        budget.add(seq.seq_id, chunk.start, chunk.end, chunk.final)
        if state.hybrid and (chunk.end % self.bs == 0 or chunk.final):
            self._reserve_checkpoint(state, seq, chunk.end, emit)

    def _reserve_checkpoint(self, state: EngineState, seq: Seq, step: int, emit: Emit) -> None:
        """Save the state after ``step`` tokens, if that identity is new and a slot (and, for a
        non-aligned step, a frozen block) can be had; saves are best effort."""
        ckpts = state.ckpts
        key, _ = state.checkpoint_identity(seq, step)
        if ckpts.find(key) is not None:
            return
        if step % self.bs and not state.pool.num_available:
            return  # no frozen block to be had: check before evicting anything for the slot
        if not ckpts.peek_slot():
            victims = ckpts.eviction_order()
            if not victims:
                return
            emit(ev.CheckpointEvicted(victims[0].ckpt_id))  # state only: its KV stays cached
        frozen = 0
        if step % self.bs:
            blocks = state.pool.peek_allocate(1)
            if blocks is None:
                return
            frozen = int(blocks[0])
        emit(ev.CheckpointReserved(ckpts.next_id, seq.seq_id, ckpts.peek_slot(), step, frozen))

    def publish_checkpoints(self, state: EngineState, emit: Emit) -> None:
        """After a successful step: publish what it saved (a duplicate identity is abandoned)."""
        for ckpt_id in list(state.awaiting_publish):
            c = state.ckpts.get(ckpt_id)
            if state.ckpts.find(c.key) is not None:
                emit(ev.CheckpointReleased(ckpt_id, "superseded"))
            else:
                emit(ev.CheckpointPublished(ckpt_id))

    def start_saves(
        self, state: EngineState, published: list[tuple[int, int, bytes]], emit: Emit
    ) -> None:
        """After a successful step, save what became saveable to the store: an attention
        model's newly computed full blocks; a hybrid model's blocks up to each aligned state
        checkpoint the step published (``published``: (seq id, tokens, identity)), with the
        state. Each save leases its blocks (and checkpoint) until the store confirms."""
        if not self.config.external_save or state.transfers.drain_pending:
            return
        t = state.seqs
        if state.hybrid:
            for seq_id, step, key in published:
                c = state.ckpts.find(key)
                seq = t.seqs.get(seq_id)
                if c is None or step % self.bs or seq is None or seq.row < 0:
                    continue
                self._save(state, seq.seq_id, seq.row, step // self.bs, c.ckpt_id, c.slot, emit)
            return
        rows = t.schedulable_rows()
        for row in rows[t.registered[rows] > t.saved[rows]].tolist():
            self._save(state, int(t.row_seq[row]), row, int(t.registered[row]), -1, -1, emit)

    def _save(
        self, state: EngineState, seq_id: int, row: int, end: int, ckpt: int, slot: int, emit: Emit
    ) -> None:
        lo = int(state.seqs.saved[row])
        if end <= lo:
            return
        blocks = state.seqs.table[row, lo:end].copy()
        emit(ev.KVSaveStarted(state.transfers.next_save_id, seq_id, blocks, lo, ckpt, slot))

    def abandon_checkpoints(self, state: EngineState, emit: Emit) -> None:
        """After a failed step: its saves never happened (publish rollback)."""
        for ckpt_id in list(state.awaiting_publish):
            emit(ev.CheckpointReleased(ckpt_id, "step failed"))

    def recover_failed_step(self, state: EngineState, reason: str, emit: Emit) -> None:
        """After a forward raised: a sequence that failed too often is aborted with the reason;
        for a hybrid model the others are preempted (their runtime state may be half-written,
        so they recompute from a checkpoint); attention-only sequences retry the same work (a
        failed forward writes KV only at positions that the retry rewrites)."""
        for seq_id in state.failed_seq_ids:
            seq = state.seqs.seqs.get(seq_id)
            if seq is None or seq.state != SeqState.RUNNING:
                continue
            if seq.num_failures > self.config.max_step_retries:
                why = f"executor failed {seq.num_failures} times: {reason}"
                self.abort(state, seq_id, why, emit)
            elif state.hybrid:
                self.preempt(state, seq, emit, "executor failed")

    def _evict_checkpoints_for(self, state: EngineState, need: int, emit: Emit, keep: int) -> bool:
        """Evict unpinned checkpoints (frozen tails first, then least recently used) until
        ``need`` blocks are available; evicts nothing and returns False if that cannot work."""
        pool = state.pool
        if pool.num_available >= need:
            return True
        order = [c for c in state.ckpts.eviction_order() if c.ckpt_id != keep]
        delta = np.zeros(pool.num_blocks, dtype=np.int32)
        gain, chosen = 0, []
        for c in order:
            blocks = c.path if not c.frozen_block else np.append(c.path, c.frozen_block)
            np.add.at(delta, blocks, 1)
            gain = int(np.count_nonzero((pool.ref == delta) & (delta > 0)))
            chosen.append(c.ckpt_id)
            if pool.num_available + gain >= need:
                for ckpt_id in chosen:
                    emit(ev.CheckpointEvicted(ckpt_id))
                return True
        return False



def _arrival_key(seq: Seq) -> tuple[float, int]:
    return (seq.arrival_time, seq.seq_id)
