"""The scheduling policy: reads EngineState, decides, and changes it only by emitting events.

``emit`` folds an event into the state at once (so later decisions of the same step see it)
and records it as a decision of the step. A decision that is not emitted leaves no trace: a
tentative prefix match that admission rejects is simply never emitted.

``Policy`` composes the parts, one module each: ``matching`` (prefix and checkpoint hits),
``admission`` (chunks, budget, admission), ``growth`` (allocation, caching, releases,
preemption victims), ``checkpoints`` (save points, publication, eviction), ``transfers``
(external-KV lookups, loads and saves). This module answers the engine's inputs (outcomes,
aborts, ends of session, drain) and runs each step's schedule: decode growth, chunk
continuation, admission.
"""

from __future__ import annotations

import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy.admission import Admission
from kvsched.policy.checkpoints import Checkpoints
from kvsched.policy.common import I32, I64, Chunk, Emit, Match, StepBudget, cdiv
from kvsched.policy.growth import Growth
from kvsched.policy.matching import Matcher
from kvsched.policy.ordering import PrefillOrder
from kvsched.policy.transfers import Transfers
from kvsched.policy.turns import PrefillTurns
from kvsched.reducers.future import reads_future, reuse_error
from kvsched.reducers.sequences import Arrival, Seq
from kvsched.reducers.state import EngineState
from kvsched.statemachines import CkptState, LoadState, SeqState, TurnState

__all__ = ["Chunk", "Match", "Policy"]


class Policy:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.bs = config.block_size
        self.matcher = Matcher(config)
        self.growth = Growth(config)
        self.checkpoints = Checkpoints(config, self.growth)
        self.transfers = Transfers(config, self.matcher)
        self.order = PrefillOrder(config, self.matcher)
        self.admission = Admission(
            config, self.matcher, self.growth, self.checkpoints, self.transfers, self.order
        )
        self.turns: PrefillTurns | None = None  # (None: every turn is STANDARD, none to choose)
        if config.turn_policy != "standard":
            self.turns = PrefillTurns(config, self.admission, self.order)
        # The parts' entry points that callers outside the policy use (benchmarks, tests),
        # bound directly: the match path is timed per request.
        self.find_prefix = self.matcher.find_prefix
        self.attach_prefix = self.admission.attach_prefix
        self.chunk_of = self.admission.chunk_of
        self.preempt = self.growth.preempt

    # ----------------------------------------------------------------------- inputs

    def validate(self, state: EngineState, e: ev.RequestArrived) -> str | Arrival:
        """Why a request must be rejected or, when it is acceptable, its tokens and block
        digests (``SequenceTable.arrival``, which its fold takes)."""
        model, bs = self.config.model, self.bs
        prompt = e.prompt
        if len(prompt) == 0:
            return "empty prompt"
        if e.max_tokens <= 0:
            return f"max_tokens must be positive, got {e.max_tokens}"
        if state.seqs.is_live(e.seq_id) or e.seq_id < 0:
            return f"duplicate or invalid request id {e.seq_id}"
        arrival = state.seqs.arrival(e)  # (the hashing pass also finds the largest id)
        top = arrival.top
        if top is None:
            top = -1 if in_vocabulary(prompt, model.vocab_size) else model.vocab_size
        if top >= model.vocab_size:
            return f"token id outside the vocabulary [0, {model.vocab_size})"
        if e.temperature < 0:
            return f"temperature must be >= 0, got {e.temperature}"
        if not -1 <= e.eos_token_id < model.vocab_size:
            return f"eos_token_id {e.eos_token_id} outside the vocabulary (or -1 for none)"
        session = state.sessions.get(e.session_id) if e.session_id >= 0 else None
        if session is not None and session.active_seq >= 0:
            return f"session {e.session_id} already has a request in flight"
        total = state.sessions.history_len(e.session_id) + len(prompt)
        if len(e.block_hashes) // ev.HASH_SIZE > total // bs:
            return "block_hashes name more blocks than the request's full blocks"
        if e.reuse:
            if not reads_future(self.config):
                return "reuse (a recorded future) is read only by checkpoints.eviction 'oracle'"
            reason = reuse_error(e.reuse, e.seq_id, total, bs)
            if reason:
                return reason
        if total >= model.max_context:
            return f"prompt of {total} tokens exceeds the maximum context {model.max_context}"
        if cdiv(total + 1, bs) > self.config.num_blocks - 1:
            return f"prompt of {total} tokens needs more KV blocks than the cache has"
        longest = min(total + e.max_tokens + self.config.speculation.lookahead, model.max_context)
        held = int(self.config.mtp_holds_overlap)  # (MTP: a hit's cached block, held too)
        if cdiv(longest, bs) + held > self.config.num_blocks - 1:
            # It could never finish alone: it would be preempted and recomputed forever.
            return (
                f"prompt of {total} tokens plus max_tokens {e.max_tokens} needs more KV blocks"
                f" than the cache has ({self.config.num_blocks - 1}"
                + (", one held beside its MTP recompute)" if held else ")")
            )
        for span in e.mm_spans:
            if not 0 <= span.start < span.end <= len(prompt):
                return f"multimodal span [{span.start}, {span.end}) outside the prompt"
        return arrival

    def after_executed(self, state: EngineState, outcome: ev.StepExecuted, emit: Emit) -> None:
        """After a step's outcome: cache the blocks it filled, publish the checkpoints it
        saved, start saves to the store, and retire the sequences whose newest token ends
        them (eos, max_tokens or context)."""
        saving = self.config.external_save and state.hybrid
        published = self._awaiting_identities(state, outcome.step) if saving else []
        self.growth.cache_computed(state, emit)
        if state.hybrid:  # (an attention model saves no checkpoint)
            self.checkpoints.publish(state, outcome.step, emit)
        if self.config.external_save:
            self.transfers.start_saves(state, published, emit)
        t = state.seqs
        landed = t.landed_ids()  # (the fold's samplers; overlapped steps: those running)
        seqs, reasons = self._ended_by_delivery(state) if t.delivered_ids() else ([], [])
        migrate = self.config.external.role == "prefill"  # (prefill role: its first token ends it)
        if len(landed):
            rows = t.rows_of(landed)  # (the fold's lookup, kept)
            stop = t.is_eos(rows)
            length = t.outputs_done(rows) | (t.known_of(rows) >= self.config.model.max_context)
            for i in np.nonzero(stop | length | migrate)[0].tolist():
                seqs.append(t.seq(int(landed[i])))
                reasons.append("stop" if stop[i] else "length" if length[i] else "migrated")
        if not seqs:
            return
        if state.hybrid and not migrate:
            for seq in seqs:
                self.checkpoints.save_sequence_end(state, seq, emit)
        ids = np.asarray([seq.seq_id for seq in seqs], dtype=np.int64)
        if self.config.legacy.report_cached_tokens:
            local, ckpt, external = np.asarray(
                [s.cached_tokens for s in seqs], dtype=np.int64
            ).reshape(-1, 3).T.copy()
            finished = ev.SequenceFinished(ids, tuple(reasons), local, ckpt, external)
        else:
            finished = ev.SequenceFinished(ids, tuple(reasons))
        self.growth.end(state, seqs, finished, emit, keep_for_session=True)

    def _ended_by_delivery(self, state: EngineState) -> tuple[list[Seq], list[str]]:
        """(overlapped steps) The preempted sequences the outcome's tokens ended, and why."""
        seqs, reasons = [], []
        for seq in map(state.seqs.seq, state.seqs.delivered_ids()):
            if seq.tokens[seq.n_tokens - 1] == seq.eos_token_id:
                seqs.append(seq)
                reasons.append("stop")
            elif seq.n_output >= seq.max_tokens or seq.n_tokens >= self.config.model.max_context:
                seqs.append(seq)
                reasons.append("length")
        return seqs, reasons

    @staticmethod
    def _awaiting_identities(state: EngineState, step: int) -> list[tuple[int, int, bytes]]:
        """(seq id, tokens, identity) of each checkpoint the executed ``step`` saved."""
        ckpts = state.ckpts
        return [(c.seq_id, c.step, c.key) for c in map(ckpts.get, ckpts.awaiting_ids(step))]

    def abort(
        self, state: EngineState, seq_id: int, reason: str, emit: Emit, close_session: bool = False
    ) -> bool:
        """Abort a sequence; False when the abort is deferred (its KV transfer is in flight:
        it is applied, once, when the load ends)."""
        seq = state.seqs.find(seq_id)
        if seq is None:
            return True  # unknown or already retired: nothing to release
        load = state.transfers.load_of(seq_id)
        if load is not None and load.in_flight:
            # A second abort changes nothing, unless it adds the end of the session.
            if not load.abort_reason or (close_session and not load.close_session):
                emit(ev.AbortDeferred(seq_id, load.abort_reason or reason, close_session))
            return False
        if load is not None and load.open:
            emit(ev.KVLoadCancelled(seq_id, reason))
        keep = self.config.legacy.keep_aborted_turns and not close_session and seq.session_id >= 0
        if seq.state == SeqState.RUNNING and keep and state.hybrid:
            self.checkpoints.save_sequence_end(state, seq, emit)
        cached = seq.cached_tokens if self.config.legacy.report_cached_tokens else (0, 0, 0)
        # (a running sequence or a load that ended releases what it holds first)
        aborted = ev.SequenceAborted(seq_id, reason, keep, *cached)
        self.growth.end(state, [seq], aborted, emit, keep_for_session=keep)
        return True

    def end_session(self, state: EngineState, session_id: int, emit: Emit) -> None:
        session = state.sessions.get(session_id)
        if session is None:
            return
        active = session.active_seq
        if active >= 0 and not self.abort(state, active, "session ended", emit, True):
            return  # closed once the active turn's load settles
        self.growth.free_session_hold(state, session_id, emit)
        emit(ev.SessionClosed(session_id))

    def settle_load(self, state: EngineState, seq_id: int, emit: Emit) -> None:
        """After a load finished or failed, the sequence runs from its good blocks: an
        attention model keeps a failed load's good leading blocks up to a multimodal-safe
        boundary (and recomputes the rest);
        a hybrid model has no state past its local prefix, so it is preempted and recomputes
        from there (it will not try the store again). A load holding a row is settled now; one
        without a row when it is admitted into one (``Admission``, first of all waiting
        work). A deferred abort or end of session happens now, exactly once."""
        load = state.transfers.load_of(seq_id)
        assert load is not None
        seq = state.seq(seq_id)
        failed = load.state == LoadState.FAILED
        if seq.row >= 0:
            emit(ev.KVLoadSettled(seq_id, self.transfers.kept_blocks(state, seq, load)))
            self.growth.cache_computed(state, emit, np.asarray([seq.row]))
        if failed and state.hybrid:
            self.growth.preempt(state, seq, emit, f"kv load failed: {load.failure}")
        if load.abort_reason:
            reason, close = load.abort_reason, load.close_session
            session_id = seq.session_id
            self.abort(state, seq_id, reason, emit)
            if close:
                self.end_session(state, session_id, emit)

    def drain(self, state: EngineState, emit: Emit, level: int = 1) -> None:
        """Preempt everything running, drop session holds and checkpoints, clear the prefix
        cache (sleep releases the device memory): afterwards nothing is held or cached, and
        ``Drained(level)`` tells the driver to let the executor sleep at that level.

        Lookups are cancelled (they are asked again after waking). Loads and saves in flight
        write or read device memory: the drain waits until they end (``DrainDeferred``, at
        the deepest level asked for); meanwhile nothing is scheduled. Loads that ended
        without a row lose their blocks with the device memory: they are preempted like
        running sequences."""
        for seq_id, load in sorted(state.transfers.loads_by_seq()):
            if load.open:
                emit(ev.KVLoadCancelled(seq_id, "drain"))
        if state.transfers.transferring:
            serving = state.serving
            if not serving.drain_pending or level > serving.drain_level:
                emit(ev.DrainDeferred(max(level, serving.drain_level)))
            return
        for seq_id in state.transfers.ready_loads():
            self.growth.preempt(state, state.seq(seq_id), emit, reason="drain")
        t = state.seqs
        for seq in t.seqs_at(t.running_rows()):
            self.growth.preempt(state, seq, emit, reason="drain")
        for session_id in sorted(state.sessions):
            self.growth.free_session_hold(state, session_id, emit)
        for c in sorted(state.ckpts.checkpoints(), key=lambda c: c.ckpt_id):
            ckpt_id = c.ckpt_id
            if c.state == CkptState.RESERVED:  # a finished sequence's state, not yet saved
                emit(ev.CheckpointAbandoned(ckpt_id, "drain"))
            else:
                emit(ev.CheckpointReleased(ckpt_id, "drain"))
        if state.pool.num_cached:
            emit(ev.CacheCleared())  # the device memory goes away, and the cache with it
        emit(ev.Drained(max(level, state.serving.sleep_level)))  # (a sleep only deepens)

    def after_failed_step(self, state: EngineState, reason: str, emit: Emit) -> None:
        """After a forward raised: its checkpoint saves never happened; a sequence that
        failed too often is aborted with the reason; for a hybrid model the others are
        preempted (their runtime state may be half-written, so they recompute from a
        checkpoint); attention-only sequences retry the same work (a failed forward writes
        KV only at positions that the retry rewrites). Under ``cache_when_planned`` the
        step's sequences are all preempted too (one may hold, as a hit, blocks another was
        to write) and the blocks it cached at planning are evicted (never written)."""
        self.checkpoints.abandon(state, emit)
        planned = self.config.cache_when_planned
        unwritten: list[tuple[int, int, bytes]] = []
        for seq_id in state.seqs.failed_ids():
            seq = state.seqs.find(seq_id)
            if seq is None or seq.state != SeqState.RUNNING:
                continue
            if planned:
                unwritten += self.growth.uncomputed(state, seq)
            if seq.num_failures > self.config.max_step_retries:
                why = f"executor failed {seq.num_failures} times: {reason}"
                self.abort(state, seq_id, why, emit)
            elif state.hybrid or planned:
                self.growth.preempt(state, seq, emit, "executor failed")
        if planned and state.seqs.pipelined:  # (and those of sequences gone meanwhile)
            unwritten += state.seqs.unwritten_of_departed()
        if unwritten:
            self.growth.uncache_failed(state, unwritten, emit)

    # --------------------------------------------------------------------- schedule

    def schedule(self, state: EngineState, emit: Emit) -> None:
        if state.sleeping:
            return
        if state.serving.drain_pending:  # (a drain goes ahead while everything is held)
            if not state.transfers.transferring:
                self.drain(state, emit, state.serving.drain_level)
            return
        if state.serving.running_held:
            return
        table = state.seqs
        preempted = state.stats.preemptions
        rows = table.schedulable_rows()
        if table.pipelined:
            rows = table.not_at_end(rows)
        decode_mask = table.awaiting_decode(rows)
        decode_rows, chunk_rows = rows[decode_mask], rows[~decode_mask]
        alternate = self.config.turns.mode == "alternate"
        prefill_turn = not (alternate and len(decode_rows)) or self._is_prefill_turn(
            state, len(decode_rows), chunk_rows
        )
        budget = StepBudget()
        if self.config.model.max_encoder_tokens:  # (the encoder inputs held at the start)
            budget.encoder_tokens = self.admission.encoder_held(state)
        if len(decode_rows) and not (alternate and prefill_turn):
            budget.busy = self._schedule_decode(state, decode_rows, emit)
        if prefill_turn:
            chunk_rows = table.still_held(chunk_rows)  # not preempted by decode
            if self.turns is not None:
                self.turns.run(state, chunk_rows, budget, emit)
            else:  # continue running chunked prefills, then admit in the configured order
                if len(chunk_rows):
                    self.admission.schedule_chunks(state, chunk_rows, budget, emit)
                if self.config.preemption.admit_after or state.stats.preemptions == preempted:
                    ordered = self.order.order(state, TurnState.STANDARD)
                    self.admission.admit_waiting(state, budget, emit, ordered)
        if budget.seq_ids and not self.config.cache_when_planned:  # (else: each emitted)
            seq_ids = np.asarray(budget.seq_ids, dtype=I64)
            starts, ends = np.asarray(budget.starts, I64), np.asarray(budget.ends, I64)
            emit(ev.PrefillScheduled(seq_ids, starts, ends))
        elif alternate and prefill_turn and len(decode_rows) and not budget.seq_ids:
            # The prefill turn found nothing it could run: decode rather than idle.
            self._schedule_decode(state, table.still_held(decode_rows), emit)

    def _is_prefill_turn(self, state: EngineState, n_decode: int, chunk_rows: np.ndarray) -> bool:
        """Alternate mode with decodes running (mixed mode, or nothing to decode, is always a
        prefill turn: ``schedule`` asks only here otherwise), as lmdeploy's
        do_prefill_default: a prefill turn when there is prefill work and, after
        at least one decode turn, the batch is less than half full, ``prefill_interval``
        decode turns have passed, a running sequence's last chunk is pending
        (``prefill_on_last_chunk``) or the waiting tokens fill a prefill budget
        (``prefill_on_waiting_tokens``)."""
        config = self.config
        if config.turns.mode == "mixed" or n_decode == 0:
            return True
        if not PrefillTurns.has_work(state, chunk_rows):
            return False
        # Every prefill turn is followed by at least one decode turn, so decoding sequences
        # always progress (otherwise admissions could starve them and thrash preemption).
        decode_turns = state.serving.decode_turns
        if decode_turns == 0:
            return False
        half_empty = state.seqs.num_running < 0.5 * config.max_batch
        if half_empty or decode_turns >= config.turns.prefill_interval:
            return True
        if config.legacy.prefill_on_last_chunk and self._last_chunk_pending(state, chunk_rows):
            return True
        return config.legacy.prefill_on_waiting_tokens and self._waiting_fill_budget(state)

    def _last_chunk_pending(self, state: EngineState, chunk_rows: np.ndarray) -> bool:
        """Whether a running sequence's next chunk ends its prompt."""
        table = state.seqs
        for row in chunk_rows.tolist():
            if self.chunk_of(table.seq_at(row), table.computed_at(row)).final:
                return True
        return False

    def _waiting_fill_budget(self, state: EngineState) -> bool:
        """Whether the waiting sequences' tokens reach ``max_prefill_tokens`` (their cached
        prefixes are not known before admission: every token counts, as in lmdeploy)."""
        total, budget = 0, self.config.max_prefill_tokens
        for seq in state.seqs.waiting_seqs():
            total += seq.n_tokens
            if total >= budget:
                return True
        return False

    def _schedule_decode(self, state: EngineState, rows: np.ndarray, emit: Emit) -> bool:
        """Grow and schedule the decoding rows (each with the drafts it verifies, if any);
        returns whether any decode was scheduled."""
        table = state.seqs
        drafting = self.config.speculation.max_drafts > 0 and not state.hybrid
        drafts = self.growth.drafts_to_verify(state, rows) if drafting else None
        slots, limit = self.config.speculation.lookahead, self.config.model.max_context
        while True:  # (once more after the spares are given back: they may hold drafts)
            if drafts is None and not slots:
                needing = table.rows_needing_blocks(rows)
                counts = np.ones(len(needing), I32)
            else:  # (drafts, and an EAGLE drafter's lookahead slots)
                short = table.blocks_short(rows, slots + (0 if drafts is None else drafts), limit)
                needing, counts = rows[short > 0], short[short > 0].astype(I32)
            short_of_room = counts.sum() > state.pool.num_available
            if not short_of_room or not self.growth.return_spares(state, emit):
                break
        if short_of_room:
            needing, counts = self._make_room(state, needing, counts, emit)
            held = table.still_held(rows)
            drafts = None if drafts is None else drafts[np.isin(rows, held)]
            rows = held
        if len(needing):
            seq_ids = table.ids_at(needing)
            if self.config.decode_prealloc_tokens:
                counts = counts + self.growth.decode_spares(state, needing, int(counts.sum()))
            self.growth.allocate(state, seq_ids, counts, emit)
        if len(rows):
            verify = None if drafts is None or not drafts.any() else drafts.astype(I32)
            emit(ev.DecodeScheduled(table.ids_at(rows), verify))
            if self.config.cache_when_planned:
                self.growth.cache_computed(state, emit, rows, planned=True)
            if state.hybrid:
                self.checkpoints.decode_saves(state, rows, emit)
        return bool(len(rows))

    def _make_room(
        self, state: EngineState, need_rows: np.ndarray, counts: np.ndarray, emit: Emit
    ) -> tuple[np.ndarray, np.ndarray]:
        """Preempt victims until every remaining row in ``need_rows`` can get its ``counts``
        blocks (one each without drafts).

        Victims: lowest priority first, then latest arrival; not necessarily a row that needs
        blocks. Returns the rows that still need (and can now get) blocks, and how many.
        """
        total = int(counts.sum())
        self.growth.return_spares(state, emit)
        self.growth.reclaim_sessions(state, total, emit, keep=-1)
        if state.hybrid:
            self.checkpoints.evict_for(state, total, emit, keep=-1)
        need = dict(zip(need_rows.tolist(), counts.tolist(), strict=True))
        running = self.growth.victims(state)
        while state.pool.num_available < total and running:
            victim = running.pop(0)
            total -= need.pop(victim, 0)
            seq = state.seqs.seq_at(victim)
            self.growth.preempt(state, seq, emit, "blocks")
        rows = sorted(need)
        return np.asarray(rows, dtype=np.int64), np.asarray([need[r] for r in rows], I32)


def in_vocabulary(tokens: np.ndarray, vocab_size: int) -> bool:
    """Whether every token id is in [0, vocab_size): one pass (a negative signed id, read as
    unsigned of the same width, is larger than any vocabulary)."""
    if tokens.dtype.kind == "i":
        tokens = tokens.view(tokens.dtype.str.replace("i", "u"))
    return bool(tokens.max() < vocab_size)
