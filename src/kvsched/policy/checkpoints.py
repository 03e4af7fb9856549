"""Hybrid models' state checkpoints: where to save, what to keep, publication after the step,
rollback after a failed step, and eviction under memory pressure.

Placement is a set of named rules (``config.checkpoint_placement``, ``config.PLACEMENTS``);
each save point is chosen by exactly one of them and carries its name (``kind``). Prefill
rules are applied by admission (chunk ends, the prompt end, branch points, intervals inside a
chunk), decode rules by the scheduler, end-of-sequence rules when a sequence finishes (its
runtime slot is saved before the next forward).

What to keep: a checkpoint needs a state slot and room in the capacity (a count, or bytes).
When there is none, unpinned checkpoints are evicted in the order of the configured eviction
("lru", "frozen_first", or "value"). Under "value" a checkpoint's priority is
greedy-dual-size-frequency (Cao and Irani, 1997; Marconi's compute-per-byte score):

    priority = floor at its last touch + (frequency ** 2) x (prefill seconds a hit saves) / cost

where the frequency is 1 + its hits (+1 for a branch checkpoint, born of a request that shared
the prefix), the saved seconds come from ``value_token_s`` and ``value_pair_s`` (tokens and
causal attention pairs), and the cost is what it uses of the capacity. Each eviction raises
the floor to the victim's priority, so an old checkpoint ages. A checkpoint made redundant by
a deeper one of the same producer (interior prefill points, or the prompt end once the
sequence's end is saved) is worth only its floor. A new checkpoint worth less than the one it
would evict is declined. Saves are best effort: a save that finds no room is skipped.
"""

from __future__ import annotations

import math

import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy import spans
from kvsched.policy.common import Emit
from kvsched.policy.growth import Growth
from kvsched.reducers.checkpoints import Checkpoint
from kvsched.reducers.sequences import Seq
from kvsched.reducers.state import EngineState
from kvsched.statemachines import CkptState

INTERIOR = frozenset(["chunk_end", "interval"])  # prefill points inside a prompt
ENDS = frozenset(["sequence_end", "session_end"])  # a finished sequence's end
# Points only an exact continuation reuses (a retry, a next turn): whether a workload has
# those is learned from how many of each rule's checkpoints were ever restored.
CONTINUATIONS = frozenset(
    ["prompt_end", "prompt_tail", "sequence_end", "session_end", "decode_latest"]
)
# The rules whose deeper checkpoint (same producer) makes a checkpoint redundant.
_DEEPER: dict[str, frozenset[str]] = {
    "chunk_end": INTERIOR, "interval": INTERIOR, "prompt_end": ENDS
}
_GROUPS_OF: dict[str, tuple[frozenset[str], ...]] = {
    kind: tuple(g for g in (INTERIOR, ENDS) if kind in g) for kind in INTERIOR | ENDS
}
# A branch checkpoint's frequency at birth: a request already shared its prefix (4, not 2:
# chosen on the Mooncake trace, docs/benchmarks.md).
BRANCH_BIRTH = 4


def _RANK(item: tuple[float, int, Checkpoint]) -> tuple[float, int]:
    return item[0], item[1]  # priority, then least recently used


class Checkpoints:
    def __init__(self, config: SchedulerConfig, growth: Growth) -> None:
        self.config = config
        self.bs = config.block_size
        self.growth = growth
        self.by_value = config.checkpoint_eviction == "value"
        self.min_gain = config.checkpoint_min_gain_blocks * config.block_size
        self.mm_safe = config.multimodal_safe

    # ------------------------------------------------------------------- placement

    def reserve(
        self,
        state: EngineState,
        seq: Seq,
        step: int,
        emit: Emit,
        kind: str,
        phase: str = "after",
    ) -> None:
        """Save the state after ``step`` tokens (rule ``kind``), if that identity is new and
        a slot and room (and, for a non-aligned step, a frozen block) can be had."""
        aligned = step % self.bs == 0
        if not aligned and (self.config.aligned_checkpoints_only or phase == "within"):
            return  # (an executor that keeps states in whole blocks only: vLLM's align mode)
        if seq.num_hit_tokens and step - seq.num_hit_tokens < self.min_gain:
            return  # barely past the state it restored: a hit on it would save almost nothing
        if self.mm_safe and not spans.boundary_safe(seq.mm_spans, step):
            return  # inside a multimodal span: no hit may ever restore it
        ckpts = state.ckpts
        key, anchor = state.seqs.identity_at(seq, step)
        if ckpts.find(key) is not None or ckpts.reserved_now(key):
            return
        if not aligned and not state.pool.num_available:
            return  # no frozen block to be had: check before evicting anything for room
        if phase == "before" and step >= self.bs and anchor not in state.pool.index:
            return  # its prefix is not indexed (a chain past a private copy): no path to hold
        cost = ckpts.cost_of(not aligned)
        worth = self._candidate_priority(state, seq.seq_id, step, kind, cost)
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
        for a session's turn) before the next forward overwrites its runtime slot."""
        config = self.config
        if config.places("sequence_end"):
            kind = "sequence_end"
        elif config.places("session_end") and seq.session_id >= 0:
            kind = "session_end"
        else:
            return
        step = int(state.seqs.computed[seq.row])
        if step:
            self.reserve(state, seq, step, emit, kind, "before")

    def decode_saves(self, state: EngineState, rows: np.ndarray, emit: Emit) -> None:
        """The decode rules: save the states the scheduled decode steps reach at their
        rule's interval (``decode``: decode_checkpoint_interval; ``decode_blocks`` and
        ``decode_latest``: block boundaries)."""
        config, table = self.config, state.seqs
        rules = [
            (kind, interval)
            for kind, interval in (
                ("decode", config.decode_checkpoint_interval),
                ("decode_blocks", self.bs),
                ("decode_latest", self.bs),
            )
            if interval and config.places(kind)
        ]
        for kind, interval in rules:
            for row in rows[(table.computed[rows] + 1) % interval == 0].tolist():
                seq = table.objs[row]
                assert seq is not None
                self.reserve(state, seq, int(table.computed[row]) + 1, emit, kind)

    # ------------------------------------------------------------------- publication

    def publish(self, state: EngineState, emit: Emit) -> None:
        """After a successful step: publish what it saved (a duplicate identity is abandoned);
        a published ``decode_latest`` checkpoint replaces its producer's older ones."""
        ckpts = state.ckpts
        index = state.pool.index
        for ckpt_id in list(ckpts.awaiting):
            c = ckpts.get(ckpt_id)
            if ckpts.find(c.key) is not None:
                emit(ev.CheckpointAbandoned(ckpt_id, "superseded"))
                continue
            if c.step >= self.bs and c.anchor not in index:
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
        """After a failed step: its saves never happened (publish rollback)."""
        for ckpt_id in list(state.ckpts.awaiting):
            emit(ev.CheckpointAbandoned(ckpt_id, "step failed"))

    # ------------------------------------------------------------------ what to keep

    def saved_seconds(self, tokens: int) -> float:
        """Prefill seconds a hit of ``tokens`` saves (linear work and attention pairs)."""
        c = self.config
        return tokens * c.value_token_s + tokens * tokens / 2 * c.value_pair_s

    @staticmethod
    def _redundant(state: EngineState, seq_id: int, kind: str, step: int) -> bool:
        """Whether a deeper checkpoint of producer ``seq_id`` makes a ``kind`` checkpoint at
        ``step`` redundant: a deeper interior prefill point, or, for the prompt end, the
        sequence's end."""
        deeper = _DEEPER.get(kind)
        if deeper is None:
            return False
        return any(o.kind in deeper and o.step > step for o in state.ckpts.produced_by(seq_id))

    def superseded(self, state: EngineState, c: Checkpoint) -> bool:
        return self._redundant(state, c.seq_id, c.kind, c.step)

    def priority(self, state: EngineState, c: Checkpoint) -> float:
        """The "value" eviction's priority (the lowest is evicted first)."""
        return self._priority(state, c.seq_id, c.kind, c.step, c.hits, c.cost, c.floor)

    def _candidate_priority(
        self, state: EngineState, seq_id: int, step: int, kind: str, cost: int
    ) -> float:
        """The priority a checkpoint about to be reserved would have."""
        return self._priority(state, seq_id, kind, step, 0, cost, state.ckpts.floor)

    def _priority(
        self,
        state: EngineState,
        seq_id: int,
        kind: str,
        step: int,
        hits: int,
        cost: int,
        floor: float,
    ) -> float:
        if self._redundant(state, seq_id, kind, step):
            return floor
        weight = self._weights(state).get(kind, 1.0)
        return floor + weight * self._worth(kind, step, hits, cost)

    def _worth(self, kind: str, step: int, hits: int, cost: int) -> float:
        freq = hits + (BRANCH_BIRTH if kind == "branch" else 1)
        return freq * freq * self.saved_seconds(step) / cost

    @staticmethod
    def _weights(state: EngineState) -> dict[str, float]:
        """Continuation rules' weights: the share of their checkpoints ever restored
        (Laplace-smoothed); other rules weigh 1."""
        ckpts = state.ckpts
        reused = ckpts.reused_by_kind
        return {
            kind: (reused.get(kind, 0) + 1) / (made + 1)
            for kind, made in ckpts.saves_by_kind.items()
            if kind in CONTINUATIONS
        }

    def _ranked(self, state: EngineState) -> list[tuple[float, int, Checkpoint]]:
        """(priority, stamp, checkpoint) of every evictable checkpoint, in one pass."""
        ckpts = state.ckpts
        weights = self._weights(state)
        deepest: dict[tuple[int, frozenset[str]], int] = {}
        for c in ckpts.ckpts.values():
            for group in _GROUPS_OF.get(c.kind, ()):
                key = (c.seq_id, group)
                if c.step > deepest.get(key, -1):
                    deepest[key] = c.step
        out: list[tuple[float, int, Checkpoint]] = []
        published = CkptState.PUBLISHED
        token_s, pair_s = self.config.value_token_s, self.config.value_pair_s
        for c in ckpts.ckpts.values():
            if c.state != published:
                continue
            kind, step = c.kind, c.step
            deeper = _DEEPER.get(kind)
            if deeper is not None and deepest.get((c.seq_id, deeper), -1) > step:
                out.append((c.floor, c.stamp, c))
                continue
            # (self._worth inlined, the same arithmetic in the same order: the hot loop)
            freq = c.hits + (BRANCH_BIRTH if kind == "branch" else 1)
            worth = freq * freq * (step * token_s + step * step / 2 * pair_s) / c.cost
            out.append((c.floor + weights.get(kind, 1.0) * worth, c.stamp, c))
        return out

    def ranked_victims(
        self, state: EngineState, keep: int = -1
    ) -> list[tuple[float | None, Checkpoint]]:
        """Unpinned published checkpoints (never ``keep``), the first to be evicted first,
        each with its priority under the "value" eviction (else None)."""
        ckpts = state.ckpts
        eviction = self.config.checkpoint_eviction
        if eviction == "value":
            ranked = sorted(self._ranked(state), key=_RANK)
            victims: list[tuple[float | None, Checkpoint]] = [(p, c) for p, _, c in ranked]
        else:
            order = ckpts.eviction_order() if eviction == "frozen_first" else ckpts.evictable()
            victims = [(None, c) for c in order]
        return [(p, c) for p, c in victims if c.ckpt_id != keep]

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
            gain = int(np.count_nonzero((pool.ref == delta) & (delta > 0)))
            chosen.append((priority, c))
            if pool.num_available + gain >= need:
                for p, victim in chosen:
                    emit(ev.CheckpointEvicted(victim.ckpt_id, p))
                return True
        return False
