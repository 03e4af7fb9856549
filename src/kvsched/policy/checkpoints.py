"""Hybrid models' state checkpoints: where to save, what to keep, publication after the step,
rollback after a failed step, and eviction under memory pressure.

Placement is a set of named rules (``config.checkpoints.placement``, ``config.PLACEMENTS``);
each save point is chosen by exactly one of them and carries its name (``kind``). Prefill
rules are applied by admission (chunk ends, the prompt end, branch points, intervals inside a
chunk), decode rules by the scheduler, end-of-sequence rules when a sequence finishes (its
runtime slot is saved before the next forward).

What to keep: a checkpoint needs a state slot and room in the capacity (a count, or bytes).
When there is none, unpinned checkpoints are evicted in the order of the eviction strategy
``config.checkpoints.eviction`` names (``policy/eviction.py``: "lru", "frozen_first", or
"value", greedy-dual-size-frequency; "oracle", the farthest next use). A new checkpoint worth
less than the one it would evict is declined (only "value" and "oracle" have worths). Saves
are best effort: a save that finds no room is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy import spans
from kvsched.policy.common import Emit
from kvsched.policy.eviction import CHECKPOINT_EVICTION
from kvsched.policy.growth import Growth
from kvsched.reducers.checkpoints import Checkpoint
from kvsched.reducers.sequences import Seq
from kvsched.reducers.state import EngineState
from kvsched.statemachines import CkptState


class Checkpoints:
    def __init__(self, config: SchedulerConfig, growth: Growth) -> None:
        self.config = config
        self.bs = config.block_size
        self.growth = growth
        self.by_value = config.checkpoints.eviction == "value"
        self.eviction = CHECKPOINT_EVICTION[config.checkpoints.eviction](config)
        self.min_gain = config.checkpoints.min_gain_blocks * config.block_size
        self.mm_safe = spans.kept_whole(config)

    # ------------------------------------------------------------------- placement

    def reserve(
        self,
        state: EngineState,
        seq: Seq,
        step: int,
        emit: Emit,
        kind: str,
        phase: str = "after",
        late: bool = False,
    ) -> None:
        """Save the state after ``step`` tokens (rule ``kind``), if that identity is new and
        a slot and room (and, for a non-aligned step, a frozen block) can be had. ``late``
        (overlapped steps): a state a step still in flight computes, saved before this
        step's forward (not if that step saves it already). A save before the forward holds
        its prefix's blocks at once: they must be cached (under ``cache_when_planned`` they
        are, as soon as their tokens are known)."""
        aligned = step % self.bs == 0
        if not aligned and (self.config.checkpoints.aligned_only or phase == "within"):
            return  # (an executor that keeps states in whole blocks only: vLLM's align mode)
        if seq.num_hit_tokens and step - seq.num_hit_tokens < self.min_gain:
            return  # barely past the state it restored: a hit on it would save almost nothing
        if self.mm_safe and not spans.boundary_safe(seq.mm_spans, step):
            return  # inside a multimodal span: no hit may ever restore it
        ckpts = state.ckpts
        key, anchor = state.seqs.identity_at(seq, step)
        if ckpts.find(key) is not None or ckpts.reserved_now(key):
            return
        if late and any(k == key for _, k in ckpts.in_flight()):
            return  # (that step saves it already)
        if not aligned and not state.pool.num_available:
            return  # no frozen block to be had: check before evicting anything for room
        if phase == "before" and step >= self.bs and not state.pool.is_cached(anchor):
            return  # its prefix is not indexed (a chain past a private copy): no path to hold
        cost = ckpts.cost_of(not aligned)
        worth = self.eviction.candidate_priority(
            ckpts, seq.seq_id, step, kind, cost, state.future
        )
        if not self._make_room(state, cost, worth, emit):
            return
        frozen = 0
        if not aligned:
            if not state.pool.num_available:
                return
            frozen = int(self.growth.take_blocks(state, 1, emit)[0])
        emit(
            ev.CheckpointReserved(
                ckpts.next_id, seq.seq_id, ckpts.peek_slot(), step, key, anchor, frozen,
                kind, phase,
            )
        )

    def save_sequence_end(self, state: EngineState, seq: Seq, emit: Emit) -> None:
        """A sequence finishing now: save its final state (rule sequence_end, or session_end
        for a session's turn) before the next forward overwrites its runtime slot; none for
        a preempted sequence that a landing token ended (overlapped steps: it holds no
        state). (A launched step that decoded the sequence's last token leaves the state
        after it: named by known tokens, it is saved.)"""
        config = self.config
        if seq.row < 0:
            return
        if config.places("sequence_end"):
            kind = "sequence_end"
        elif config.places("session_end") and seq.session_id >= 0:
            kind = "session_end"
        else:
            return
        step = state.seqs.computed_at(seq.row)
        if step:
            self.reserve(state, seq, step, emit, kind, "before")

    def decode_saves(self, state: EngineState, rows: np.ndarray, emit: Emit) -> None:
        """The decode rules: save the states the scheduled decode steps reach at their
        rule's interval (``decode``: decode_checkpoint_interval; ``decode_blocks`` and
        ``decode_latest``: block boundaries). With overlapped steps a decode whose position
        is a placeholder cannot name the state it reaches (the name hashes a token still in
        flight): that state is saved one step later, before the next forward overwrites it,
        once its tokens are known."""
        config, table = self.config, state.seqs
        known = table.newest_known(rows)
        late, reached = table.late_states(rows)
        rules = [
            (kind, interval)
            for kind, interval in (
                ("decode", config.checkpoints.decode_interval),
                ("decode_blocks", self.bs),
                ("decode_latest", self.bs),
            )
            if interval and config.places(kind)
        ]
        for kind, interval in rules:
            for row in known[(table.computed_of(known) + 1) % interval == 0].tolist():
                seq = table.seq_at(row)
                self.reserve(state, seq, table.computed_at(row) + 1, emit, kind)
            for row, step in zip(late.tolist(), reached.tolist(), strict=True):
                if step % interval == 0:
                    self.reserve(state, table.seq_at(row), step, emit, kind, "before", True)

    # ------------------------------------------------------------------- publication

    def publish(self, state: EngineState, step: int, emit: Emit) -> None:
        """After ``step`` succeeded: publish what it saved (a duplicate identity is
        abandoned); a published ``decode_latest`` checkpoint replaces its producer's older
        ones."""
        ckpts = state.ckpts
        pool = state.pool
        for ckpt_id in ckpts.awaiting_ids(step):
            c = ckpts.get(ckpt_id)
            if ckpts.find(c.key) is not None:
                emit(ev.CheckpointAbandoned(ckpt_id, "superseded"))
                continue
            if c.step >= self.bs and not pool.is_cached(c.anchor):
                # (without dedup, a chain past a private copy is not indexed: no path to hold)
                emit(ev.CheckpointAbandoned(ckpt_id, "prefix not cached"))
                continue
            emit(ev.CheckpointPublished(ckpt_id))
            if c.kind == "decode_latest":
                for old in ckpts.produced_by(c.seq_id):
                    replaced = old.kind == "decode_latest" and old.step < c.step
                    if replaced and old.state == CkptState.PUBLISHED:
                        emit(ev.CheckpointReleased(old.ckpt_id, "replaced"))

    def abandon(self, state: EngineState, emit: Emit) -> None:
        """After a failed step: its saves never happened (publish rollback), nor those of a
        step launched after it (overlapped steps: voided, planned on the failed one)."""
        for ckpt_id in state.ckpts.awaiting_ids():
            emit(ev.CheckpointAbandoned(ckpt_id, "step failed"))

    # ------------------------------------------------------------------ what to keep

    def ranked_victims(
        self, state: EngineState, keep: int = -1
    ) -> Iterator[tuple[float | None, Checkpoint]]:
        """Unpinned published checkpoints (never ``keep``), the first to be evicted first,
        each with its priority under the eviction strategy (None: it has none); lazily (the
        order is the one at this call: evicting the first ones does not change it)."""
        victims = self.eviction.ranked(state.ckpts, state.future)
        return ((p, c) for p, c in victims if c.ckpt_id != keep)

    def eviction_order(self, state: EngineState, keep: int = -1) -> list[Checkpoint]:
        return [c for _, c in self.ranked_victims(state, keep)]

    def _make_room(self, state: EngineState, cost: int, worth: float, emit: Emit) -> bool:
        """Evict until a slot and ``cost`` of room are free; under "value", decline (False)
        when the next victim is worth more than the new checkpoint."""
        ckpts = state.ckpts
        if ckpts.peek_slot() and ckpts.room() >= cost:
            return True
        for priority, victim in self.ranked_victims(state):
            if priority is not None and priority > worth:
                return False
            emit(ev.CheckpointEvicted(victim.ckpt_id, priority))
            if ckpts.peek_slot() and ckpts.room() >= cost:
                return True
        return False

    def room_for_load(self, state: EngineState, emit: Emit) -> bool:
        """A slot and room for the state a load without a row writes (an aligned state's
        cost), evicting in the eviction order; never declined for value: a load brings a
        whole prefix. False: every slot is pinned or reserved (the load waits)."""
        return self._make_room(state, state.ckpts.cost_of(False), math.inf, emit)

    def evict_for(self, state: EngineState, need: int, emit: Emit, keep: int) -> bool:
        """Evict unpinned checkpoints (in eviction order) until ``need`` blocks are
        available; evicts nothing and returns False if that cannot work. ``keep`` (the
        checkpoint an admission is about to pin) is never evicted."""
        pool = state.pool
        if pool.num_available >= need:
            return True
        delta = np.zeros(pool.num_blocks, dtype=np.int32)
        chosen: list[tuple[float | None, Checkpoint]] = []
        for priority, c in self.ranked_victims(state, keep):
            blocks = c.path if not c.frozen_block else np.append(c.path, c.frozen_block)
            np.add.at(delta, blocks, 1)
            gain = int(np.count_nonzero(pool.freed_by(delta)))
            chosen.append((priority, c))
            if pool.num_available + gain >= need:
                for p, victim in chosen:
                    emit(ev.CheckpointEvicted(victim.ckpt_id, p))
                return True
        return False
