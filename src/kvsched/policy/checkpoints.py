"""Hybrid models' state checkpoints: where to save, publication after the step, rollback after
a failed step, and eviction under memory pressure.

Save points: a block-aligned chunk end, the prompt end (a non-aligned end freezes a copy of
its partial block), and every ``decode_checkpoint_interval`` decode tokens. Saves are best
effort: a slot (one unpinned checkpoint may be evicted for it, its KV stays cached) and, when
non-aligned, a block must be available. Under KV pressure unpinned checkpoints are evicted
(frozen tails first, then least recently used) only when that makes the need fit.
"""

from __future__ import annotations

import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy.common import Emit
from kvsched.policy.growth import Growth
from kvsched.reducers.checkpoints import Checkpoint
from kvsched.reducers.sequences import Seq
from kvsched.reducers.state import EngineState


class Checkpoints:
    def __init__(self, config: SchedulerConfig, growth: Growth) -> None:
        self.config = config
        self.bs = config.block_size
        self.growth = growth

    def reserve(self, state: EngineState, seq: Seq, step: int, emit: Emit) -> None:
        """Save the state after ``step`` tokens, if that identity is new and a slot (and, for a
        non-aligned step, a frozen block) can be had."""
        if step % self.bs and self.config.aligned_checkpoints_only:
            return  # (an executor that keeps states in whole blocks only: vLLM's align mode)
        ckpts = state.ckpts
        key, anchor = state.seqs.identity_at(seq, step)
        if ckpts.find(key) is not None:
            return
        if step % self.bs and not state.pool.num_available:
            return  # no frozen block to be had: check before evicting anything for the slot
        if not ckpts.peek_slot():
            victims = ckpts.eviction_order()
            if not victims:
                return
            self.evict(state, victims[0], emit)  # state only: its KV stays cached
        frozen = 0
        if step % self.bs:
            if not state.pool.num_available:
                return
            frozen = int(self.growth.take_blocks(state, 1, emit)[0])
        emit(
            ev.CheckpointReserved(
                ckpts.next_id, seq.seq_id, ckpts.peek_slot(), step, key, anchor, frozen
            )
        )

    def evict(self, state: EngineState, c: Checkpoint, emit: Emit) -> None:
        emit(ev.CheckpointEvicted(c.ckpt_id))

    def publish(self, state: EngineState, emit: Emit) -> None:
        """After a successful step: publish what it saved (a duplicate identity is abandoned)."""
        for ckpt_id in list(state.ckpts.awaiting):
            c = state.ckpts.get(ckpt_id)
            if state.ckpts.find(c.key) is not None:
                emit(ev.CheckpointAbandoned(ckpt_id, "superseded"))
            else:
                emit(ev.CheckpointPublished(ckpt_id))

    def abandon(self, state: EngineState, emit: Emit) -> None:
        """After a failed step: its saves never happened (publish rollback)."""
        for ckpt_id in list(state.ckpts.awaiting):
            emit(ev.CheckpointAbandoned(ckpt_id, "step failed"))

    def evict_for(self, state: EngineState, need: int, emit: Emit, keep: int) -> bool:
        """Evict unpinned checkpoints (frozen tails first, then least recently used) until
        ``need`` blocks are available; evicts nothing and returns False if that cannot work.
        ``keep`` (the checkpoint an admission is about to pin) is never evicted."""
        pool = state.pool
        if pool.num_available >= need:
            return True
        order = [c for c in state.ckpts.eviction_order() if c.ckpt_id != keep]
        delta = np.zeros(pool.num_blocks, dtype=np.int32)
        chosen: list[Checkpoint] = []
        for c in order:
            blocks = c.path if not c.frozen_block else np.append(c.path, c.frozen_block)
            np.add.at(delta, blocks, 1)
            gain = int(np.count_nonzero((pool.ref == delta) & (delta > 0)))
            chosen.append(c)
            if pool.num_available + gain >= need:
                for victim in chosen:
                    self.evict(state, victim, emit)
                return True
        return False
