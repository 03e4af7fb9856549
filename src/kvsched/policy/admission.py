"""Prefill: canonical chunks, the per-step token budget, continuing chunked prefills, and
admitting waiting sequences (with a local prefix hit, or with a load from the store), loads
that ended first.

Rules: the first prefill of a step is always admitted, others must fit the token budget;
chunk boundaries are multiples of ``config.chunk_tokens`` (a function of the request and the
config, never of the cache hit), moved out of multimodal spans (``spans.py``: a span is a
chunk of its own); at most ``max_long_chunks_per_step`` non-final chunks per
step, and none of a long prefill (more than a chunk of tokens left) on a gated prefill turn
(policy/turns.py); FCFS and priority orders stop at the first request that does not fit, the
TTFT order skips it. An admission that does not fit leaves no trace (its tentative match is
never emitted).

External loads (``load_admission="soft"``, lmdeploy's): a load takes no batch row and holds
only its local prefix and the blocks it loads into (hybrid: a state slot too); it is admitted
only if its whole prefill fits beside every incomplete load's soft reservation (the prompt
blocks each still lacks), so the admitted loads' prefills always fit the cache together and
two loads can never wait on each other's blocks. Ordinary admissions and decode may borrow
reserved blocks: they run, finish or are preempted, and give them back. A load that ended is
settled into a row before anything else waiting is admitted. While every row runs, loads
still start.
"""

from __future__ import annotations

import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy import spans
from kvsched.policy.checkpoints import Checkpoints
from kvsched.policy.common import I64, Chunk, Emit, Match, StepBudget, cdiv
from kvsched.policy.growth import Growth
from kvsched.policy.matching import Matcher
from kvsched.policy.ordering import PrefillOrder
from kvsched.policy.transfers import Transfers
from kvsched.reducers.seq import FREE_ROW, NO_BLOCKS
from kvsched.reducers.sequences import Seq
from kvsched.reducers.state import EngineState
from kvsched.statemachines import SeqState


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        matcher: Matcher,
        growth: Growth,
        checkpoints: Checkpoints,
        transfers: Transfers,
        order: PrefillOrder,
    ) -> None:
        self.config = config
        self.bs = config.block_size
        # (an EAGLE drafter's lookahead slots past a chunk take blocks too: allocate_slots)
        self._slots, self._ctx = config.speculation.lookahead, config.model.max_context
        self.matcher = matcher
        self.growth = growth
        self.checkpoints = checkpoints
        self.transfers = transfers
        self.order = order
        aligned = config.external_save or config.checkpoints.aligned_only
        self._tail = config.hybrid and config.places("prompt_tail")
        cut_tail = self._tail and not config.checkpoints.mid_chunk_saves
        self._split_tail = config.hybrid and (aligned or cut_tail)
        self._branch = config.hybrid and config.places("branch")
        self._within = config.hybrid and config.checkpoints.mid_chunk_saves
        self._cut_at_branch = self._branch and not self._within
        self._interval = config.interval_tokens if config.places("interval") else 0
        self._soft = config.soft_loads
        self._lora_slots = config.model.max_adapters  # (0: any number of adapters run)
        self._mm_safe = spans.kept_whole(config)
        self._encoder_budget = config.model.max_encoder_tokens  # (0: none)
        # (derived settings read once: each admission reads them)
        self._external_load = config.external_load
        self._chunk_tokens = config.chunk_tokens
        self._prompt_end = config.places("prompt_end")
        self._chunk_end = config.places("chunk_end")
        self._oracle = config.hybrid and config.places("oracle")
        self._pipelined = config.hybrid and config.speculation.pipelined

    # ---------------------------------------------------------------------- chunks

    def chunk_of(self, seq: Seq, start: int, branch: int = -1) -> Chunk:
        """The canonical chunk starting at ``start``: it ends at the next multiple of the
        chunk length (a function of the request and the config only) or at the prompt end;
        a multimodal span is never split (``spans.chunk_end``). Where the executor cannot
        save mid-chunk, it ends at a ``branch`` point inside it (the end of the cached KV
        found at admission; -1: none) so that its state is saved there."""
        size = self._chunk_tokens
        end = min(seq.n_tokens, (start // size + 1) * size)
        if seq.mm_spans and self._mm_safe:
            end = spans.chunk_end(seq.mm_spans, start, end)
        if self._split_tail and end == seq.n_tokens:
            # Hybrid models saving to the store or saving aligned states only: end a chunk at
            # the deepest block boundary a lookup of this prompt (or of it plus its first
            # token) can use, so an aligned state checkpoint exists there to be saved.
            cut = self.tail_of(seq)
            if start < cut < end and self._may_cut(seq, cut):
                end = cut
        if self._cut_at_branch and start < branch < end and self._may_cut(seq, branch):
            end = branch
        return Chunk(start, end, end == seq.n_tokens)

    def _may_cut(self, seq: Seq, step: int) -> bool:
        """Whether a chunk may end at ``step`` besides its canonical end: never in a span."""
        return not self._mm_safe or spans.boundary_safe(seq.mm_spans, step)

    def refusal(self, budget: StepBudget, seq: Seq, chunk: Chunk, held: bool = False) -> str:
        """Why this step cannot take the chunk, or "" when it can: "skip" when a gate closes
        (at most ``max_long_chunks_per_step`` non-final chunks per step; on a gated turn, no
        chunk of a long prefill), "stop" when it overruns the token budget (the first
        prefill of a step never does) or the encoder budget (``model.max_encoder_tokens``:
        the span positions it embeds beside those the step's chunks embed and those held at
        the step's start; a chunk alone runs). ``held``: a running sequence's next chunk."""
        if not budget.long_prefills and self.config.long_prefill(seq.n_tokens - chunk.start):
            return "skip"
        if not chunk.final and budget.long_chunks >= self.config.turns.max_long_chunks_per_step:
            return "skip"
        fits = budget.tokens + chunk.end - chunk.start <= self.config.max_prefill_tokens
        if not fits and budget.prefills:
            return "stop"
        if self._encoder_budget and seq.mm_spans and budget.encoder_tokens:
            embeds = spans.embedded(seq.mm_spans, chunk.start, chunk.end, self._mm_safe, held)
            if embeds and budget.encoder_tokens + embeds > self._encoder_budget:
                return "stop"
        return ""

    def encoder_held(self, state: EngineState) -> int:
        """The span positions whose encoder output the running sequences hold at the step's
        start (``spans.held_positions``): with an encoder budget, the step's chunks embed at
        most the budget less these."""
        table, held = state.seqs, 0
        flights = table.flight_starts() if table.pipelined else {}
        for row in table.running_rows().tolist():
            seq = table.seq_at(row)
            if seq.mm_spans:
                computed = table.computed_at(row)
                held += spans.held_positions(seq.mm_spans, computed, flights.get(row, computed))
        return held

    def add_prefill(
        self,
        state: EngineState,
        seq: Seq,
        chunk: Chunk,
        budget: StepBudget,
        emit: Emit,
        held: bool = False,
    ) -> None:
        """Schedule a chunk (the step's budget counts it; ``held``: a running sequence's next
        chunk); for a hybrid model, save the states its placement rules ask for: at its end
        (the deepest first), then inside it (deepest first)."""
        budget.seq_ids.append(seq.seq_id)
        budget.starts.append(chunk.start)
        budget.ends.append(chunk.end)
        budget.tokens += chunk.end - chunk.start
        if seq.mm_spans:
            embeds = spans.embedded(seq.mm_spans, chunk.start, chunk.end, self._mm_safe, held)
            budget.encoder_tokens += embeds
        budget.prefills += 1
        budget.long_chunks += 0 if chunk.final else 1
        if self.config.cache_when_planned:  # scheduled at once: a later admission may hit it
            one, start, end = (np.asarray([x], I64) for x in (seq.seq_id, chunk.start, chunk.end))
            emit(ev.PrefillScheduled(one, start, end))
            self.growth.cache_computed(state, emit, np.asarray([seq.row]), planned=True)
        if not state.hybrid:
            return
        if self._oracle:
            self.oracle_saves(state, seq, chunk, emit)
            return
        kind = self.end_rule(seq, chunk)
        if kind:
            self.checkpoints.reserve(state, seq, chunk.end, emit, kind)
        if self._within:
            for step, rule in self.points_within(seq, chunk):
                self.checkpoints.reserve(state, seq, step, emit, rule, "within")

    def oracle_saves(self, state: EngineState, seq: Seq, chunk: Chunk, emit: Emit) -> None:
        """Rule "oracle": save the state at each depth in the chunk where the recorded future
        says a later request's hit will end (at its end, then inside it, deepest first)."""
        for step in reversed(state.future.depths(seq.seq_id)):
            if chunk.start < step <= chunk.end:
                phase = "after" if step == chunk.end else "within"
                self.checkpoints.reserve(state, seq, step, emit, "oracle", phase)

    def end_rule(self, seq: Seq, chunk: Chunk) -> str:
        """The placement rule that saves the state at a chunk's end ("" for none)."""
        end = chunk.end
        if self._branch and end == seq.kv_hit_tokens:
            return "branch"
        if chunk.final and self._prompt_end:
            return "prompt_end"
        if not chunk.final and self._tail and end == self.tail_of(seq):
            return "prompt_tail"
        if end % self.bs == 0 and self._chunk_end:
            return "chunk_end"
        return ""

    def points_within(self, seq: Seq, chunk: Chunk) -> list[tuple[int, str]]:
        """Block boundaries strictly inside a chunk where a rule saves the state (the
        branch point, and every ``checkpoint_interval`` tokens), deepest first."""
        lo, hi = chunk.start, chunk.end
        if (hi - 1) // self.bs * self.bs <= lo:
            return []  # no block boundary strictly inside (every rule's points are on one)
        points: dict[int, str] = {}
        if self._interval:
            first = (lo // self._interval + 1) * self._interval
            for step in range(first, hi, self._interval):
                points[step] = "interval"
        if self._tail and lo < self.tail_of(seq) < hi:
            points[self.tail_of(seq)] = "prompt_tail"
        if self._branch and lo < seq.kv_hit_tokens < hi:
            points[seq.kv_hit_tokens] = "branch"
        return sorted(points.items(), reverse=True)

    def tail_of(self, seq: Seq) -> int:
        """The deepest block boundary a repeat of the prompt can restore (a hit never covers
        the prompt's last token)."""
        return (seq.n_tokens - 1) // self.bs * self.bs

    # -------------------------------------------------------------- running chunks

    def schedule_chunks(
        self, state: EngineState, rows: np.ndarray, budget: StepBudget, emit: Emit
    ) -> None:
        """Continue the chunked prefills of running sequences, oldest first."""
        table = state.seqs
        for seq in sorted(table.seqs_at(table.still_held(rows)), key=_arrival_key):
            if seq.state != SeqState.RUNNING:
                continue  # preempted for an earlier sequence's chunk this step
            chunk = self.chunk_of(seq, table.computed_at(seq.row), seq.kv_hit_tokens)
            if self.refusal(budget, seq, chunk, held=True):
                continue
            need = self._blocks_to(chunk.end) - table.nblocks_at(seq.row)
            if need > state.pool.num_available:
                self.growth.return_spares(state, emit)
                self.growth.reclaim_sessions(state, need, emit, keep=-1)
            if need > state.pool.num_available and state.hybrid:
                self.checkpoints.evict_for(state, need, emit, keep=-1)
            if need > state.pool.num_available:
                if not budget.busy and budget.prefills == 0:
                    # Nothing else can progress: preempt victims (maybe this one itself),
                    # then run the chunk (else a waiting sequence could take the room).
                    self.growth.preempt_until(state, need, emit, spare=seq)
                if seq.state != SeqState.RUNNING or need > state.pool.num_available:
                    continue
            self.growth.allocate(state, [seq.seq_id], [need], emit)
            self.add_prefill(state, seq, chunk, budget, emit, held=True)

    # ------------------------------------------------------------------- admission

    def admit_waiting(
        self, state: EngineState, budget: StepBudget, emit: Emit, ordered: list[Seq]
    ) -> None:
        """Offer admission to the waiting sequences in ``ordered`` (policy/ordering.py)."""
        table = state.seqs
        stop_on_failure = self.config.order != "ttft"
        if self._soft and not self._settle_ready(state, budget, emit, stop_on_failure):
            return
        if state.serving.admissions_held:
            return  # (ready loads above hold their blocks: they settle even while held)
        for seq in ordered:
            if table.num_running >= self.config.max_batch and not self._soft:
                return  # (a load takes no row: while every row runs, loads still start)
            if seq.preempted_at == state.step:
                continue  # preempted to make room this step: not readmitted in the same step
            if self._external_load and self.transfers.awaits_lookup(state, seq, emit):
                continue  # the store is being asked: skipped until it answers
            verdict = self.try_admit(state, seq, budget, emit)
            if verdict == "stop" and stop_on_failure:
                return

    def _blocks_to(self, end: int) -> int:
        """Blocks a sequence holds to compute up to ``end``: with an EAGLE drafter, also its
        lookahead slots past it, up to the context (vLLM's ``allocate_slots``)."""
        return -(-(end + self._slots if end + self._slots < self._ctx else self._ctx) // self.bs)

    def try_admit(self, state: EngineState, seq: Seq, budget: StepBudget, emit: Emit) -> str:
        """Admit one waiting sequence, or return why not ('skip' or 'stop') leaving no trace."""
        if self._lora_slots and seq.adapter and self._one_adapter_too_many(state, seq):
            return "skip"
        match = self.matcher.find_prefix(state, seq)
        if self._pipelined and self.matcher.deeper_state_in_flight(state, seq, match.num_tokens):
            return "stop"  # (its state lands within two steps; the later ones wait behind it)
        if self._external_load:
            first, end = self.transfers.planned_load(state, seq, match.num_tokens)
            if end:
                return self._admit_with_load(state, seq, first, end, budget, emit)
        if self._soft and state.seqs.num_running >= self.config.max_batch:
            return "skip"  # every row runs (only loads start now): it waits for a row
        chunk = self.chunk_of(seq, match.num_tokens, match.kv_tokens)
        refusal = self.refusal(budget, seq, chunk)
        if refusal:
            return refusal
        need = self._blocks_to(chunk.end) - len(match.blocks)
        if not self.make_fit(state, need, match.blocks, match.ckpt_id, emit, match.overlap):
            return "stop"
        load = state.transfers.load_of(seq.seq_id) if self._external_load else None
        if load is not None and load.open:
            emit(ev.KVLoadCancelled(seq.seq_id, "served by the local cache"))
        self.attach_prefix(state, seq, match, emit)
        if seq.session_id in state.sessions:
            self.growth.free_session_hold(state, seq.session_id, emit)
        self.growth.allocate(state, [seq.seq_id], [need], emit)
        self.add_prefill(state, seq, chunk, budget, emit)
        return "admitted"

    def _one_adapter_too_many(self, state: EngineState, seq: Seq) -> bool:
        """Whether running ``seq`` would make its adapter one more than ``model.max_adapters``
        (vLLM's max_loras: it is skipped for the step)."""
        running = state.seqs.running_adapters()
        return seq.adapter not in running and len(running) >= self._lora_slots

    def attach_prefix(self, state: EngineState, seq: Seq, match: Match, emit: Emit) -> None:
        """Commit a match: take a batch row, pin the checkpoint (hybrid) and attach the cached
        blocks (statistics counted on the first admission only, not after preemption)."""
        first = seq.num_preemptions == 0
        emit(ev.SequenceAdmitted(seq.seq_id, state.seqs.peek_free_row()))
        if match.ckpt_id >= 0:
            emit(ev.CheckpointPinned(match.ckpt_id, seq.seq_id))
        if match.num_tokens or match.overlap or first:
            query = seq.n_prompt if first else 0
            emit(
                ev.PrefixMatched(
                    seq.seq_id, match.blocks, match.num_tokens, query, match.ckpt_id,
                    match.kv_tokens, match.overlap,
                )
            )

    def _admit_with_load(
        self, state: EngineState, seq: Seq, first: int, end: int, budget: StepBudget, emit: Emit
    ) -> str:
        """Admit a sequence whose chain blocks [first, end) load from the store; it computes
        nothing until the load settles. Soft loads: no row, only the blocks it loads into
        (and, hybrid, a state slot), if its whole prefill fits beside every incomplete load's
        soft reservation. Else (before schema 4): a row and every block of its prompt. A
        synchronous load has ended when it starts: it is settled into a row at once if one is
        free (its first chunk runs in this step, after the executor's load), else later."""
        soft = self._soft
        hit = state.pool.cached_prefix(seq.hashes, first)
        assert len(hit) == first, "the local part of a planned load is cached"
        if soft and state.hybrid and not self.checkpoints.room_for_load(state, emit):
            return "stop"
        if not self.make_fit(state, self.transfers.load_need(state, seq, first), hit, -1, emit):
            return "stop"
        row = FREE_ROW if soft else state.seqs.peek_free_row()
        emit(ev.KVLoadAdmitted(seq.seq_id, row, first, end))
        first_admission = seq.num_preemptions == 0
        query = seq.n_prompt if first_admission else 0
        emit(ev.PrefixMatched(seq.seq_id, hit, first * self.bs, query))
        if seq.session_id in state.sessions:
            self.growth.free_session_hold(state, seq.session_id, emit)
        taken = end if soft else cdiv(seq.n_tokens, self.bs)  # (whole prompt: before schema 4)
        self.growth.allocate(state, [seq.seq_id], [taken - first], emit)
        started = self.transfers.load_started(state, seq, first, end)
        emit(started)
        if started.synchronous and state.seqs.num_running < self.config.max_batch:
            self._settle_into_row(state, seq, budget, emit)  # (else it waits, ready)
        return "admitted"

    def _settle_ready(
        self, state: EngineState, budget: StepBudget, emit: Emit, stop_on_failure: bool
    ) -> bool:
        """Admit the sequences whose load ended (still without a row) before anything else
        waiting (lmdeploy: remote-ready first): each takes a row with its blocks. False:
        admission stops here (fcfs and priority stop at the first that does not fit)."""
        table = state.seqs
        ready = [state.seq(s) for s in state.transfers.ready_loads()]
        for seq in self.order.settled(state, ready):
            if table.num_running >= self.config.max_batch:
                return True  # (loads may still start)
            verdict = self._settle_into_row(state, seq, budget, emit)
            if verdict == "stop" and stop_on_failure:
                return False
        return True

    def _settle_into_row(self, state: EngineState, seq: Seq, budget: StepBudget, emit: Emit) -> str:
        """Settle a load that ended into a row: it runs from the blocks it keeps (the loaded
        ones are cached now) and its first chunk is scheduled, or it waits ('skip', 'stop')."""
        if self._lora_slots and seq.adapter and self._one_adapter_too_many(state, seq):
            return "skip"
        load = state.transfers.load_of(seq.seq_id)
        assert load is not None
        kept = self.transfers.kept_blocks(state, seq, load)
        chunk = self.chunk_of(seq, kept * self.bs, seq.kv_hit_tokens)
        refusal = self.refusal(budget, seq, chunk)
        if refusal:
            return refusal
        need = self._blocks_to(chunk.end) - len(state.seqs.block_table(seq))
        if not self.make_fit(state, need, NO_BLOCKS, -1, emit):
            return "stop"
        slot = state.ckpts.load_slot_of(seq.seq_id)
        emit(ev.KVLoadSettled(seq.seq_id, kept, state.seqs.peek_free_row(), slot))
        self.growth.allocate(state, [seq.seq_id], [need], emit)
        # (cached after the allocation: a loaded block deduplicated onto a cached copy that
        # no one holds takes that copy off the available blocks)
        self.growth.cache_computed(state, emit, np.asarray([seq.row]))
        self.add_prefill(state, seq, chunk, budget, emit)
        return "admitted"

    def make_fit(
        self,
        state: EngineState,
        need: int,
        hit: np.ndarray,
        keep: int,
        emit: Emit,
        overlap: int = 0,
    ) -> bool:
        """Make ``need`` blocks available besides the ``hit`` an admission attaches (and the
        MTP ``overlap`` block it holds), by releasing other sessions' holds or evicting
        checkpoints (never ``keep``, the one it restores) only when that makes the admission
        fit. False: it cannot fit."""
        pool = state.pool
        restored = state.ckpts.get(keep) if keep >= 0 else None
        # The path of the restored checkpoint, which holds references on it, has no unheld
        # block (no pass over it is needed); nor has an empty hit.
        held = restored is not None and hit is restored.path and restored.holds_path
        unheld = 0 if held or not len(hit) else pool.count_unheld(hit)
        if overlap:
            unheld += int(pool.is_unheld(overlap))
            hit = np.append(hit, np.int32(overlap)).astype(np.int32)
        shortfall = need - (pool.num_available - unheld)
        if shortfall <= 0:
            return True
        # Decode rows' spare blocks go back first (none unless decode_prealloc_tokens).
        spare = self.growth.num_spares(state)
        if state.hybrid:
            # Unheld hit blocks count as available but are attached, not taken.
            if not self.checkpoints.evict_for(state, need + unheld - spare, emit, keep=keep):
                return False
            self.growth.return_spares(state, emit)
        elif shortfall > spare + self.growth.reclaim_gain(state, -1, hit):
            return False
        else:
            self.growth.return_spares(state, emit)
            # Any session's hold may go, the admitted sequence's own too: the admission
            # releases it anyway (after attaching what the hit shares with it).
            self.growth.reclaim_sessions(state, need, emit, -1, hit)
        # (Evicting a checkpoint whose path overlaps an unheld hit gains nothing for it.)
        return need <= pool.num_available - pool.count_unheld(hit)


def _arrival_key(seq: Seq) -> tuple[float, int]:
    return (seq.arrival_time, seq.seq_id)
