"""External KV: when to look a waiting sequence up in the store, whether a planned load is
still worth taking, and which blocks (and aligned checkpoints) to save after a step.

Every transfer decision carries its store keys' ingredients (the namespace root and the block
hashes), so whoever carries the decision out needs nothing but the event.
"""

from __future__ import annotations

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy.common import Emit, cdiv
from kvsched.policy.matching import Matcher
from kvsched.reducers.sequences import Seq
from kvsched.reducers.state import EngineState
from kvsched.reducers.transfers import KVLoad
from kvsched.statemachines import LoadState


class Transfers:
    def __init__(self, config: SchedulerConfig, matcher: Matcher) -> None:
        self.config = config
        self.bs = config.block_size
        self.matcher = matcher
        # A hybrid load without a row writes its state to a checkpoint slot: with none, no load.
        self._no_state_slot = config.hybrid and config.soft_loads and not (
            config.num_checkpoint_slots
        )

    def lookup_range(self, state: EngineState, seq: Seq) -> tuple[int, int]:
        """(first, end): the chain blocks the store could add beyond the local match. A hit
        never covers the last known token; for a hybrid model the local part is what a
        checkpoint serves. MTP: an attention model asks for the whole prompt and loads one
        block less than the store has (``planned_load``); a hybrid model's state cannot be
        trimmed, so its lookup stops short of the blocks MTP recomputes."""
        trim = self.config.mtp_recompute_blocks
        if self.config.mtp_holds_overlap and not state.hybrid:
            trim = 0
        end = (seq.n_tokens - 1) // self.bs - trim
        match = self.matcher.find_prefix(state, seq)
        return match.num_tokens // self.bs, end

    def awaits_lookup(self, state: EngineState, seq: Seq, emit: Emit) -> bool:
        """Start the store lookup of a sequence that has none; True while it is pending (a
        lookup the step's lookup port answered is not: the sequence is admitted now)."""
        load = state.transfers.load_of(seq.seq_id)
        if load is None:
            if seq.want_experts or self._no_state_slot or seq.skip_hit:
                return False  # no expert ids in the store, no slot for a state, or no hit wanted
            first, end = self.lookup_range(state, seq)
            if first >= end:
                return False  # the local cache serves every block the store could
            hashes = seq.hashes.packed(first, end)
            emit(ev.KVLookupStarted(seq.seq_id, first, end, seq.root, hashes, state.hybrid))
            load = state.transfers.load_of(seq.seq_id)
        return load is not None and load.state == LoadState.LOOKUP_PENDING

    def planned_load(self, state: EngineState, seq: Seq, hit_tokens: int) -> tuple[int, int]:
        """(first, end) of a usable planned load, else (0, 0). The local part is the cached
        KV chain (for a hybrid model the loaded state replaces a local checkpoint); it must
        still reach the block the lookup started from. Neither ends inside a multimodal
        span; MTP recomputes the last block the store has (attention)."""
        load = state.transfers.load_of(seq.seq_id)
        if load is None or load.state != LoadState.PLANNED:
            return 0, 0
        end = self._load_end(state, seq, load.num_blocks)
        if end * self.bs <= hit_tokens:
            return 0, 0  # the local cache now serves as much
        local = len(state.pool.cached_prefix(seq.hashes, end))
        if local < load.first_block:
            return 0, 0  # the local part the lookup relied on was evicted meanwhile
        if local >= end and not state.hybrid:
            return 0, 0  # nothing to load (a hybrid model may still load the state at end)
        if not state.hybrid:
            local = self.matcher.safe_depth(seq, local)  # (the lookup's first is safe)
        return local, end

    def _load_end(self, state: EngineState, seq: Seq, stored: int) -> int:
        """Where a load of the ``stored`` blocks the store has ends: an attention model's
        moves out of multimodal spans (and, with MTP, one block back: recomputed); a hybrid
        model's state inside a span is of no use."""
        if state.hybrid:
            safe = self.matcher.safe_depth(seq, stored) == stored
            return stored if safe else 0
        if self.config.mtp_holds_overlap:
            stored = max(0, stored - self.config.mtp_recompute_blocks)
        return self.matcher.safe_depth(seq, stored)

    def load_started(self, state: EngineState, seq: Seq, first: int, end: int) -> ev.KVLoadStarted:
        """The load of chain blocks [first, end) into the sequence's blocks (and, for a hybrid
        model, the state stored at block end - 1 into its runtime slot, or, without a row,
        into the next free checkpoint slot, which the load then owns); synchronous (ended
        when started) where the store said so and the load takes no row (soft loads: it is
        then settled like any load that ended)."""
        blocks = state.seqs.block_table(seq)[first:end].copy()
        hashes = seq.hashes.packed(first, end)
        load = state.transfers.load_of(seq.seq_id)
        sync = load is not None and load.sync and self.config.soft_loads
        if not state.hybrid:
            return ev.KVLoadStarted(seq.seq_id, blocks, first, seq.root, hashes, synchronous=sync)
        slot = state.ckpts.runtime_slot(seq.row) if seq.row >= 0 else state.ckpts.peek_slot()
        anchor = seq.hashes[end - 1]
        return ev.KVLoadStarted(
            seq.seq_id, blocks, first, seq.root, hashes, slot, anchor, synchronous=sync
        )

    def kept_blocks(self, state: EngineState, seq: Seq, load: KVLoad) -> int:
        """The chain blocks a sequence keeps when its load settles: every loaded block, or
        a failed load's good leading ones up to a multimodal-safe boundary (attention); a
        hybrid model has no state past its local prefix after a failure, so it keeps none
        past it."""
        if load.state != LoadState.FAILED:
            return load.first_block + load.good_blocks
        good = 0 if state.hybrid else load.good_blocks
        # (never inside a multimodal span; the load's first block is outside)
        return max(load.first_block, self.matcher.safe_depth(seq, load.first_block + good))

    def load_need(self, state: EngineState, seq: Seq, first: int) -> int:
        """The blocks a load admission must find available besides the local prefix it
        attaches: its whole prefill (so that it can complete; lmdeploy's full-prefill check)
        and, for soft loads, every incomplete load's soft reservation. Then the admitted
        loads' prefills always fit the cache together: none can wait on another's blocks."""
        prefill = cdiv(seq.n_tokens, self.bs) - first
        return prefill + self.soft_reserved(state) if self.config.soft_loads else prefill

    def soft_reserved(self, state: EngineState) -> int:
        """Blocks reserved softly for admitted loads' incomplete prefills: the prompt blocks
        each still lacks (waiting for its transfer or a row, or settled and prefilling). Only
        a load admission honours them; ordinary admissions and decode may borrow them."""
        table, total = state.seqs, 0
        for seq_id, load in state.transfers.loads_by_seq():
            if load.admitted:
                seq = table.seq(seq_id)
                total += max(0, cdiv(seq.n_prompt, self.bs) - len(table.block_table(seq)))
        return total

    def start_saves(
        self, state: EngineState, published: list[tuple[int, int, bytes]], emit: Emit
    ) -> None:
        """After a successful step, save what became saveable to the store: an attention
        model's newly cached full blocks; a hybrid model's blocks up to each aligned state
        checkpoint the step published (``published``: (seq id, tokens, identity)), with the
        state. Each save leases its blocks (and checkpoint) until the store confirms."""
        if not self.config.external_save or state.serving.drain_pending:
            return
        t = state.seqs
        if state.hybrid:
            for seq_id, step, key in published:
                c = state.ckpts.find(key)
                seq = t.find(seq_id)
                if c is None or step % self.bs or seq is None or seq.row < 0:
                    continue
                self._save(state, seq, step // self.bs, c.ckpt_id, c.slot, emit)
            return
        rows = t.schedulable_rows()
        saving = t.rows_to_save(rows)
        ends = t.written_blocks(saving).tolist()
        for row, end in zip(saving.tolist(), ends, strict=True):
            self._save(state, t.seq_at(row), end, -1, -1, emit)

    def _save(
        self, state: EngineState, seq: Seq, end: int, ckpt: int, slot: int, emit: Emit
    ) -> None:
        row = seq.row
        lo = state.seqs.saved_at(row)
        if end <= lo:
            return
        blocks = state.seqs.path_blocks(seq, lo, end)  # the cached chain (no MTP private copy)
        hashes = seq.hashes.packed(lo, end)
        save_id = state.transfers.next_save_id
        emit(ev.KVSaveStarted(save_id, seq.seq_id, blocks, lo, seq.root, hashes, ckpt, slot))
