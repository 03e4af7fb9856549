"""Prefill ordering: the order in which waiting sequences are offered admission.

* ``fcfs``: arrival order.
* ``priority``: higher priority first; waiting ages a request up one level per ``aging_s``.
* ``ttft``: size-aware, by the engine's prefill turn (``policy/turns.py``; lmdeploy's
  ``_PrefillReorderer``). A waiting request is sized by the tokens left to compute after its
  tentative prefix match (``Matcher.find_prefix``, a pure query: nothing is emitted); it is
  *long* when more than a chunk of them is left (``config.long_prefill``), *short* otherwise.

  - STANDARD and SHORT_ONLY: the short requests by size (then arrival), then the long lane
    (a SHORT_ONLY turn's gate skips it).
  - LONG_FIRST and LONG_FIRST_IF_FINAL: the head of the long lane first, then the short ones
    by size, then the rest of the lane.

  The long lane is ordered by ``long_order``: ``size`` (fewest chunks left, minus one per
  ``aging_s`` waited, so long prompts are never starved) or ``fifo`` (arrival).

  Logs before schema 4 sized by the whole context, session history included
  (``ttft_size="context"``).
"""

from __future__ import annotations

from typing import NamedTuple

from kvsched.config import SchedulerConfig
from kvsched.policy.common import cdiv
from kvsched.policy.matching import Matcher
from kvsched.reducers.sequences import Seq
from kvsched.reducers.state import EngineState
from kvsched.statemachines import TurnState


class Sized(NamedTuple):
    """A waiting request and the prefill it needs now."""

    seq: Seq
    left: int  # tokens to compute after the tentative prefix match
    chunks: int  # canonical chunks they span
    long: bool  # more than a chunk of tokens left


def _seq_arrival(s: Seq) -> tuple[float, int]:
    return (s.arrival_time, s.seq_id)


def _arrival(s: Sized) -> tuple[float, int]:
    return _seq_arrival(s.seq)


class PrefillOrder:
    def __init__(self, config: SchedulerConfig, matcher: Matcher) -> None:
        self.config = config
        self.matcher = matcher
        self._by_context = config.legacy.ttft_size == "context"

    def sizes(self, state: EngineState, waiting: list[Seq]) -> list[Sized]:
        """Each waiting request's prefill after its tentative prefix match (TTFT order)."""
        chunk, config = self.config.chunk_tokens, self.config
        out = []
        for seq in waiting:
            n = seq.n_tokens
            start = 0 if self._by_context else self.matcher.find_prefix(state, seq).num_tokens
            left = n - start
            out.append(Sized(seq, left, cdiv(n, chunk) - start // chunk, config.long_prefill(left)))
        return out

    def order(
        self, state: EngineState, turn: TurnState, sized: list[Sized] | None = None
    ) -> list[Seq]:
        """The waiting sequences in the order the turn offers them admission (``sized``:
        their sizes when the caller has them)."""
        config = self.config
        if config.order == "fcfs":
            return sorted(state.seqs.waiting_seqs(), key=_seq_arrival)
        if config.order == "priority":
            return self._by_priority(list(state.seqs.waiting_seqs()), state.clock)
        if sized is None:
            sized = self.sizes(state, list(state.seqs.waiting_seqs()))
        shorts = sorted((s for s in sized if not s.long), key=lambda s: (s.left, *_arrival(s)))
        lane = self._long_lane([s for s in sized if s.long], state.clock)
        if turn in (TurnState.LONG_FIRST, TurnState.LONG_FIRST_IF_FINAL):
            return [s.seq for s in lane[:1] + shorts + lane[1:]]
        return [s.seq for s in shorts + lane]

    def settled(self, state: EngineState, seqs: list[Seq]) -> list[Seq]:
        """Sequences whose load ended, in the order they take rows (before anything else
        waiting): the priority order's own under ``priority``, else arrival (lmdeploy:
        remote-ready first, in arrival order)."""
        if self.config.order == "priority":
            return self._by_priority(seqs, state.clock)
        return sorted(seqs, key=_seq_arrival)

    def _by_priority(self, seqs: list[Seq], clock: float) -> list[Seq]:
        """Higher priority first, one level more per ``aging_s`` waited; then arrival."""
        return sorted(
            seqs, key=lambda s: (-(s.priority + self._age(s, clock)), s.arrival_time, s.seq_id)
        )

    def _long_lane(self, longs: list[Sized], clock: float) -> list[Sized]:
        if self.config.turns.long_order == "fifo":
            return sorted(longs, key=_arrival)
        return sorted(
            longs, key=lambda s: (s.chunks - self._age(s.seq, clock), s.chunks, *_arrival(s))
        )

    def _age(self, seq: Seq, clock: float) -> int:
        """Aging levels: one per ``aging_s`` waited."""
        return int(max(0.0, clock - seq.arrival_time) // self.config.aging_s)
