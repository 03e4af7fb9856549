"""Turns: the engine's prefill turn (the PrefillTurn machine) and, under lmdeploy's interleaving,
the short turns run since the last long chunk.

``PrefillTurnChosen`` moves the machine (the policy emits it only when the turn changes).
``PrefillScheduled`` is checked against the turn (a gated turn schedules no long prefill: more
than a chunk of tokens left) and, under ``interleave``, counts: a long prefill resets the count,
a short-only turn that scheduled anything adds one. The policy reads ``turn`` and
``long_turn_due``; it never counts anything itself, so a replay recomputes the same turns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.reducers.errors import ReplayMismatch
from kvsched.reducers.sequences import SequenceTable
from kvsched.statemachines import PREFILL_TURN, TurnState, fire

Folds = dict[type[ev.Event], Callable[[Any], None]]

_T = TurnState
# The states each policy may be in: its own, and long-first after a fallback.
ALLOWED: dict[str, frozenset[TurnState]] = {
    "standard": frozenset({_T.STANDARD}),
    "long_first": frozenset({_T.LONG_FIRST}),
    "short_only": frozenset({_T.SHORT_ONLY, _T.LONG_FIRST}),
    "long_first_if_final": frozenset({_T.LONG_FIRST_IF_FINAL, _T.LONG_FIRST}),
    "interleave": frozenset({_T.STANDARD, _T.SHORT_ONLY, _T.LONG_FIRST}),
}
INITIAL: dict[str, TurnState] = {
    "standard": _T.STANDARD,
    "long_first": _T.LONG_FIRST,
    "short_only": _T.SHORT_ONLY,
    "long_first_if_final": _T.LONG_FIRST_IF_FINAL,
    "interleave": _T.STANDARD,
}
# Turns that schedule no long prefill.
GATED: frozenset[TurnState] = frozenset({_T.SHORT_ONLY, _T.LONG_FIRST_IF_FINAL})


def turn_name(turn: TurnState) -> str:
    """The event's name of a turn ("short_only" for SHORT_ONLY)."""
    return turn.name.lower()


class Turns:
    def __init__(self, config: SchedulerConfig, seqs: SequenceTable) -> None:
        self.policy = config.turn_policy
        self.quota = config.turns.short_per_long
        self._config = config
        self._seqs = seqs
        self._counting = self.policy == "interleave"
        self.turn = INITIAL[self.policy]
        self.short_turns = 0  # interleave: short-only turns since the last long chunk

    @property
    def long_turn_due(self) -> bool:
        return self.short_turns >= self.quota

    @property
    def gated(self) -> bool:
        """Whether the current turn schedules no long prefill."""
        return self.turn in GATED

    def folds(self) -> Folds:
        return {ev.PrefillTurnChosen: self._on_chosen, ev.PrefillScheduled: self._on_prefill}

    def _on_chosen(self, e: ev.PrefillTurnChosen) -> None:
        try:
            dest = TurnState[e.turn.upper()]
        except KeyError:
            raise ReplayMismatch(f"unknown prefill turn {e.turn!r}") from None
        turn = fire(PREFILL_TURN, e, 0, self.turn, context=dest)
        if turn != dest or turn not in ALLOWED[self.policy]:
            raise ReplayMismatch(f"prefill turn {e.turn!r} under policy {self.policy!r}")
        self.turn = turn

    def _on_prefill(self, e: ev.PrefillScheduled) -> None:
        if not (self._counting or self.turn in GATED):
            return
        rows = self._seqs.rows_of(e.seq_ids)
        left = self._seqs.ntokens[rows] - e.starts
        long = self._config.long_prefill(int(left.max()))
        if long and self.turn in GATED:
            raise ReplayMismatch(f"a {turn_name(self.turn)} turn scheduled a long prefill")
        if not self._counting:
            return
        if long:
            self.short_turns = 0
        elif self.turn == _T.SHORT_ONLY:
            self.short_turns += 1

    def check_invariants(self) -> str | None:
        if self.turn not in ALLOWED[self.policy]:
            return f"prefill turn {self.turn.name} under policy {self.policy!r}"
        if not 0 <= self.short_turns <= (self.quota if self._counting else 0):
            return f"{self.short_turns} short turns counted (quota {self.quota})"
        return None

    def snapshot(self) -> tuple[object, ...]:
        return (self.turn, self.short_turns)
