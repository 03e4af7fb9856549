"""StepWork: what a step's plan carries besides the forward; Serving: the step counter, the
clock, sleep and drain.

``StepWork`` collects, in decision order, the state-slot and block copies the current step's
plan needs (hybrid models: runtime slots to zero at admission, checkpoints to restore before
the forward and to save after it or within it, the states loads wrote to restore into the
row they are settled into, the final states of sequences that finished in the step just
executed, partial blocks to freeze), and the engine's hit counters when the step started
(the step's own hits are the difference). It reads the sequence and checkpoint tables for
rows and slots, and the statistics. Reset by ``StepStarted``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvsched.events import types as ev
from kvsched.reducers.checkpoints import CheckpointTable
from kvsched.reducers.errors import RefChange
from kvsched.reducers.sequences import SequenceTable
from kvsched.reducers.stats import Stats

Folds = dict[type[ev.Event], Callable[[Any], RefChange | None]]


@attrs.define(slots=True)
class StepExtras:
    state_zero: list[int] = attrs.field(factory=list)
    state_restore: list[tuple[int, int]] = attrs.field(factory=list)
    state_save: list[tuple[int, int]] = attrs.field(factory=list)
    copy_after: list[tuple[int, int]] = attrs.field(factory=list)
    # saves of sequences that finished in the step just executed (before everything else)
    state_save_before: list[tuple[int, int]] = attrs.field(factory=list)
    copy_before: list[tuple[int, int]] = attrs.field(factory=list)
    # (batch row, tokens, checkpoint slot): mid-chunk saves
    state_save_within: list[tuple[int, int, int]] = attrs.field(factory=list)
    # (row, block index, frozen block): copy the frozen block into the row's private block
    restore_blocks: list[tuple[int, int, int]] = attrs.field(factory=list)
    hit_tokens_before: int = 0  # the engine's hit counters when the step started
    query_tokens_before: int = 0


class StepWork:
    def __init__(
        self, seqs: SequenceTable, ckpts: CheckpointTable, stats: Stats, hybrid: bool
    ) -> None:
        self._seqs = seqs
        self._ckpts = ckpts
        self._stats = stats
        self.hybrid = hybrid
        self.extras = StepExtras()

    def step_hits(self) -> tuple[int, int]:
        """(hit tokens, query tokens) of the current step's first admissions."""
        return (
            self._stats.hit_tokens - self.extras.hit_tokens_before,
            self._stats.query_tokens - self.extras.query_tokens_before,
        )

    def folds(self) -> Folds:
        out: Folds = {ev.StepStarted: self._on_step_started}
        if self.hybrid:
            out[ev.SequenceAdmitted] = self._on_admitted
            out[ev.KVLoadAdmitted] = self._on_admitted
            out[ev.KVLoadSettled] = self._on_load_settled
            out[ev.CheckpointReserved] = self._on_ckpt_reserved
            out[ev.CheckpointPinned] = self._on_ckpt_pinned
        return out

    def _on_step_started(self, e: ev.StepStarted) -> None:
        s = self._stats
        self.extras = StepExtras(hit_tokens_before=s.hit_tokens, query_tokens_before=s.query_tokens)

    def _on_admitted(self, e: ev.SequenceAdmitted | ev.KVLoadAdmitted) -> None:
        if e.row >= 0:  # (a load without a row has no runtime slot)
            self.extras.state_zero.append(CheckpointTable.runtime_slot(e.row))

    def _on_load_settled(self, e: ev.KVLoadSettled) -> None:
        """A load without a row enters its row: its loaded state moves into the runtime slot."""
        if e.state_slot >= 0:
            self.extras.state_restore.append((e.state_slot, CheckpointTable.runtime_slot(e.row)))

    def _on_ckpt_reserved(self, e: ev.CheckpointReserved) -> None:
        row, bs, x = self._seqs.seq(e.seq_id).row, self._seqs.block_size, self.extras
        if e.phase == "within":
            x.state_save_within.append((row, e.num_tokens, e.slot))
            return
        before = e.phase == "before"
        if e.frozen_block:
            partial = int(self._seqs.table[row, e.num_tokens // bs])
            (x.copy_before if before else x.copy_after).append((partial, e.frozen_block))
        pair = (CheckpointTable.runtime_slot(row), e.slot)
        (x.state_save_before if before else x.state_save).append(pair)

    def _on_ckpt_pinned(self, e: ev.CheckpointPinned) -> None:
        c = self._ckpts.ckpts[e.ckpt_id]  # (both checked by the owners' folds before this one)
        row = self._seqs.seqs[e.seq_id].row
        self.extras.state_restore.append((c.slot, CheckpointTable.runtime_slot(row)))
        if c.frozen_block:
            depth = c.step // self._seqs.block_size
            self.extras.restore_blocks.append((row, depth, c.frozen_block))


class Serving:
    """The step counter and clock, sleep (after a drain) at its level and a deferred drain
    with the level it will sleep at, whether admissions, and running work, are held
    (``AdmissionsHeld``), and the count of consecutive decode-only steps (alternate turn
    mode)."""

    def __init__(self) -> None:
        self.step = 0
        self.clock = 0.0
        self.sleeping = False
        self.sleep_level = 0  # while sleeping: ev.SLEEP_LEVELS
        self.drain_pending = False
        self.drain_level = 0  # while a drain is deferred: the level it sleeps at
        self.decode_turns = 0
        self.admissions_held = False
        self.running_held = False  # (only with admissions held: nothing is scheduled)

    def folds(self) -> Folds:
        return {
            ev.StepStarted: self._on_step_started,
            ev.Drained: self._on_drained,
            ev.Woken: self._on_woken,
            ev.DrainDeferred: self._on_drain_deferred,
            ev.PrefillScheduled: self._on_prefill,
            ev.DecodeScheduled: self._on_decode,
            ev.AdmissionsHeld: self._on_hold,
        }

    def _on_hold(self, e: ev.AdmissionsHeld) -> None:
        self.admissions_held = bool(e.held)
        self.running_held = bool(e.held and e.running)

    def _on_step_started(self, e: ev.StepStarted) -> None:
        self.step, self.clock = e.step, e.clock

    def _on_drained(self, e: ev.Drained) -> None:
        self.sleeping, self.drain_pending = True, False
        self.sleep_level, self.drain_level = e.level, 0

    def _on_woken(self, e: ev.Woken) -> None:
        self.sleeping, self.sleep_level = False, 0
        self.drain_pending = False  # a wake before a deferred drain cancels it
        self.drain_level = 0

    def _on_drain_deferred(self, e: ev.DrainDeferred) -> None:
        self.drain_pending = True
        self.drain_level = e.level

    def _on_prefill(self, e: ev.PrefillScheduled) -> None:
        self.decode_turns = 0

    def _on_decode(self, e: ev.DecodeScheduled) -> None:
        self.decode_turns += 1

    def check_invariants(self) -> str | None:
        """A sleep level exactly while sleeping, a drain level exactly while one is deferred,
        running work held only with admissions."""
        if (self.sleep_level in ev.SLEEP_LEVELS) != self.sleeping:
            return f"sleep level {self.sleep_level} while sleeping is {self.sleeping}"
        if (self.drain_level in ev.SLEEP_LEVELS) != self.drain_pending:
            return f"drain level {self.drain_level} while a drain pending is {self.drain_pending}"
        if self.running_held and not self.admissions_held:
            return "running work held while admissions are not"
        return None

    def snapshot(self) -> tuple[object, ...]:
        return (
            self.step, self.clock, self.sleeping, self.sleep_level, self.drain_pending,
            self.drain_level, self.decode_turns, self.admissions_held, self.running_held,
        )
