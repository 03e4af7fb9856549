"""Prefill turns (lmdeploy's ``_PrefillTurnPolicy`` and its engine's interleaving): which kind
of prefill turn a step takes, and running it.

A turn is a state of the PrefillTurn machine (``statemachines/machines.py``), held by the
``Turns`` owner; the policy emits ``PrefillTurnChosen`` only when the turn changes. A *long*
prefill has more than a chunk of tokens left after its tentative match (a running chunked
prefill: after its computed tokens); the others are *short*.

* ``standard`` / ``long_first``: every turn is STANDARD / LONG_FIRST.
* ``short_only`` / ``long_first_if_final``: every turn is SHORT_ONLY / LONG_FIRST_IF_FINAL
  (gated: no long prefill runs), except that a step with only long work takes LONG_FIRST.
* ``interleave`` (lmdeploy's engine): STANDARD while nothing long waits or runs; with long work,
  SHORT_ONLY turns (when there is short work to offer) until ``short_turns_per_long`` of them
  ran since the last long chunk, then LONG_FIRST.

A gated turn that schedules nothing while long work waits falls back to LONG_FIRST in the same
step (lmdeploy's engine does the same), so no policy starves long prompts. Orders other than
``ttft`` take STANDARD turns: their own order, long prefills allowed, exactly as before; a
policy whose every turn is STANDARD has no turn to choose, and ``Policy`` runs its prefills
without this class.
"""

from __future__ import annotations

import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy.admission import Admission
from kvsched.policy.common import Emit, StepBudget
from kvsched.policy.ordering import PrefillOrder, Sized
from kvsched.reducers.state import EngineState
from kvsched.reducers.turns import GATED, INITIAL, turn_name
from kvsched.statemachines import TurnState

_T = TurnState


class PrefillTurns:
    def __init__(self, config: SchedulerConfig, admission: Admission, order: PrefillOrder) -> None:
        self.config = config
        self.admission = admission
        self.order = order
        self.policy = config.turn_policy
        self._keeps_turn = self.policy in ("standard", "long_first")
        # The gated turn of the policy (interleave: short-only turns).
        self._gate = _T.SHORT_ONLY if self.policy == "interleave" else INITIAL[self.policy]

    def run(
        self, state: EngineState, chunk_rows: np.ndarray, budget: StepBudget, emit: Emit
    ) -> None:
        """Continue running chunked prefills and admit waiting ones, in this step's turn."""
        if not self.has_work(state, chunk_rows):
            return  # no prefill work: nothing to schedule, the turn stays
        turn = state.turns.turn
        # Sized when the turn is chosen, before running chunks continue (a sequence they
        # preempt is not readmitted in the same step anyway).
        sized = self.order.sizes(state, list(state.seqs.waiting_seqs()))
        long_work = False
        if not self._keeps_turn:
            short_work, long_work = self._work(state, chunk_rows, sized)
            turn = self._choose(state, short_work, long_work)
            if turn != state.turns.turn:
                emit(ev.PrefillTurnChosen(turn_name(turn)))
        self._run_turn(state, turn, chunk_rows, budget, emit, sized)
        if turn in GATED and long_work and not budget.prefills:
            emit(ev.PrefillTurnChosen(turn_name(_T.LONG_FIRST), fallback=True))
            rows = state.seqs.still_held(chunk_rows)  # (not preempted meanwhile)
            self._run_turn(state, _T.LONG_FIRST, rows, budget, emit, None)

    @staticmethod
    def has_work(state: EngineState, chunk_rows: np.ndarray) -> bool:
        """Whether a prefill turn has anything to offer: a waiting sequence, a running chunked
        prefill, or a load that ended and waits for a row."""
        return bool(state.seqs.has_waiting or len(chunk_rows) or state.transfers.ready_loads())

    def _run_turn(
        self,
        state: EngineState,
        turn: TurnState,
        chunk_rows: np.ndarray,
        budget: StepBudget,
        emit: Emit,
        sized: list[Sized] | None,
    ) -> None:
        budget.long_prefills = turn not in GATED
        self.admission.schedule_chunks(state, chunk_rows, budget, emit)
        self.admission.admit_waiting(state, budget, emit, self.order.order(state, turn, sized))

    def _work(
        self, state: EngineState, chunk_rows: np.ndarray, sized: list[Sized]
    ) -> tuple[bool, bool]:
        """(short work, long work): whether a short / a long prefill waits or runs."""
        table = state.seqs
        left = table.tokens_left(chunk_rows)
        kinds = [self.config.long_prefill(n) for n in left.tolist()]
        kinds += [s.long for s in sized]
        return not all(kinds), any(kinds)

    def _choose(self, state: EngineState, short_work: bool, long_work: bool) -> TurnState:
        """The turn of a step with prefill work (short, long or both)."""
        if self.policy == "interleave":
            if not long_work:
                return _T.STANDARD
            if state.turns.long_turn_due:
                return _T.LONG_FIRST
        return self._gate if short_work else _T.LONG_FIRST
