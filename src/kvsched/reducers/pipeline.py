"""PipelinedRows: overlapped steps' part of the sequence table (``speculation.pipelined``;
``SequenceTable`` builds on it, and its folds call these).

With overlapped steps (vLLM's async scheduling) step N+1 is planned while step N runs: N's
outcome is an input of step N+1 or, at the latest, of N+2. When step N+1 starts, step N's
scheduled work is *launched* (``launch``): its rows' computed tokens advance to the work's
ends (the executor runs steps in order, so every later step reads KV that N wrote), and each
row that samples in N counts a *placeholder* (``ahead``) for the token it does not know yet.
Planning reads the known tokens plus the placeholders (``planned_known``): a row whose
placeholder is its newest position decodes it, with input id -1 (the executor feeds the token
it sampled for that row in the step before, as vLLM's GPU runner does).

A step's outcome *lands* (``land``) oldest first: the token of each sampler that is still in
its row replaces its placeholder. A sequence that left its row since the launch is matched
by row and departure, never by position: one that ended or was aborted drops its token; a
preempted one gets it (as vLLM delivers a preempted request's in-flight output). It is never
admitted again before the token lands (vLLM's rule holds by construction): it was preempted
while planning the step after the launch, which does not readmit it, and the token lands
before the next step is planned (``check_pipeline``).
Nothing is cached before it is written: a block enters the prefix index once the step that
writes it has landed (``cacheable``; under ``cache_when_planned``, at planning as vLLM does).

A failed step voids the step launched after it (its work was planned on the failed one's):
the rows of both roll back to the work's starts and lose their placeholders, and the voided
step's outcome, when it comes, is dropped. Neither step's blocks were cached, so the rows
retry their work as after any failed step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

import attrs
import numpy as np

from kvsched.events import types as ev
from kvsched.reducers.drafts import DraftRows
from kvsched.reducers.seq import Seq

_NO_ROWS = np.zeros(0, dtype=np.int64)


@attrs.define
class InFlight:
    """A launched step whose outcome has not landed."""

    step: int
    rows: np.ndarray  # the rows it computes, in plan order
    starts: np.ndarray
    samplers: np.ndarray  # the rows that sample
    sampler_ids: np.ndarray  # their sequences (the outcome's expected ids)
    left: set[int] = attrs.field(factory=set)  # rows freed since the launch
    void: bool = False  # planned on a step that failed: its outcome is dropped


@attrs.frozen
class Landed:
    """What an outcome lands: the rows its step computed and those that sampled (still
    holding their sequences), their tokens; the sequences that left their rows since the
    launch (preempted, ended) and their tokens."""

    rows: np.ndarray
    samplers: np.ndarray
    tokens: np.ndarray
    left_ids: np.ndarray
    left_tokens: np.ndarray


class PipelinedRows(DraftRows):
    def __init__(
        self,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        max_context: int,
        max_drafts: int,
        pipelined: bool = False,
    ) -> None:
        super().__init__(max_batch, max_blocks, block_size, max_context, max_drafts)
        self.pipelined = pipelined  # (RowTable's, False there)
        self.ahead = np.zeros(max_batch, dtype=np.int64)  # placeholders per row
        self.freed_columns.append(self.ahead)  # (a row freed drops its placeholders)
        self.in_flight: deque[InFlight] = deque()
        self._landed = _NO_ROWS  # the sequences whose rows the latest outcome's tokens reached
        self._delivered: list[int] = []  # and (overlapped steps) the preempted ones it reached

    # ------------------------------------------------------------------------- queries


    def landed_ids(self) -> np.ndarray:
        """The sequences whose rows the latest outcome's tokens reached (overlapped steps:
        those still running)."""
        return self._landed

    def delivered_ids(self) -> list[int]:
        """(overlapped steps) The preempted sequences the latest outcome's tokens reached."""
        return self._delivered

    def planned_known(self, rows: np.ndarray) -> np.ndarray:
        """Tokens each row knows plus its placeholders (what planning reads)."""
        return self.ntokens[rows] + self.ahead[rows]  # type: ignore[no-any-return]

    def awaiting_decode(self, rows: np.ndarray) -> np.ndarray:
        """Whether each row has computed all but its newest position (its next work decodes)."""
        return (  # type: ignore[no-any-return]
            self.computed[rows] == self.ntokens[rows] + self.ahead[rows] - 1
        )

    def newest_known(self, rows: np.ndarray) -> np.ndarray:
        """Those of ``rows`` whose newest position's token is known (no placeholder): a
        state saved after it can be named (a checkpoint's identity hashes its tokens)."""
        return rows[self.ahead[rows] == 0]  # type: ignore[no-any-return]

    def not_at_end(self, rows: np.ndarray) -> np.ndarray:
        """(overlapped steps) Those of ``rows`` not at their end once their placeholders'
        tokens land (``max_tokens``, the context): they are not scheduled again."""
        known = self.planned_known(rows)
        done = (known - self.n_prompt[rows] >= self.max_tokens[rows]) | (
            known >= self.max_context
        )
        return rows[~(done & (self.ahead[rows] > 0))]  # type: ignore[no-any-return]

    def sampling_seq_ids(self) -> np.ndarray:
        """Sequences whose pending work reaches their newest position (they sample)."""
        return self.row_seq[  # type: ignore[no-any-return]
            self._pending_rows[
                self._pending_ends
                >= self.ntokens[self._pending_rows] + self.ahead[self._pending_rows]
            ]
        ]

    def cacheable(self) -> np.ndarray:
        """Each row's computed tokens less those a live step in flight writes."""
        if not self.in_flight:
            return self.computed
        out: np.ndarray = self.computed.copy()
        for flight in self.in_flight:
            if not flight.void:
                rows, starts = self._live(flight)
                out[rows] = np.minimum(out[rows], starts)
        return out

    @property
    def awaiting_outcomes(self) -> list[tuple[int, np.ndarray]]:
        """(step, expected sampler ids) of each step whose outcome is owed, oldest first: the
        launched ones, then the pending one (launched when the next step starts)."""
        owed = [(f.step, f.sampler_ids) for f in self.in_flight]
        if self.has_pending:
            owed.append((self.pending_step, self.sampling_seq_ids()))
        return owed

    def check_pipeline(self) -> str | None:
        """What breaks the overlapped steps' invariants (None when nothing does): at most one
        step in flight between steps (two only while one is launched and the older lands);
        placeholders only with it, only in running rows, at most one per step in flight, and
        each row's count is that of the live steps in flight it samples in."""
        if not self.pipelined:
            return "placeholders without overlapped steps" if self.in_flight else None
        if len(self.in_flight) > 1:
            return f"{len(self.in_flight)} steps in flight between steps"
        if np.any(self.ahead < 0) or np.any(self.ahead[self.free_rows] != 0):
            return "a negative placeholder count, or one in a free row"
        count = np.zeros_like(self.ahead)
        for flight in filter(lambda f: not f.void, self.in_flight):
            left = np.isin(flight.samplers, list(flight.left))
            count[flight.samplers[~left]] += 1
            gone = flight.sampler_ids[left]
            if np.isin(gone, self.row_seq).any():
                return f"a sequence of {gone.tolist()} runs again before its token lands"
        if not np.array_equal(count, self.ahead):
            return "placeholders disagree with the steps in flight"
        if not self.cache_when_planned and np.any(
            self.registered > self.cacheable() // self.block_size
        ):
            return "a block a step in flight writes is cached"
        return None

    # ----------------------------------------------------------------------- commands

    def _launch(self, e: ev.StepStarted) -> None:
        """``StepStarted``'s fold with overlapped steps: the step before goes out."""
        self.step = e.step
        self.launch()

    def launch(self) -> None:
        """The pending step goes out (the next step starts before its outcome lands)."""
        if not self.has_pending:
            return
        rows, starts, ends = self.pending_arrays()
        samplers = rows[ends >= self.planned_known(rows)]
        self.computed[rows] = ends
        self.ahead[samplers] += 1
        self.in_flight.append(
            InFlight(self.pending_step, rows, starts, samplers, self.row_seq[samplers].copy())
        )
        self.clear_pending()

    def land(self, seq_ids: np.ndarray, tokens: np.ndarray) -> Landed:
        """The oldest launched step's outcome, its samplers' placeholders taken off (the
        caller appends the tokens). A voided step lands nothing."""
        flight = self.in_flight.popleft()
        if flight.void:
            return Landed(_NO_ROWS, _NO_ROWS, tokens[:0], _NO_ROWS, tokens[:0])
        if not np.array_equal(seq_ids, flight.sampler_ids):  # (plan order is the common case)
            order = np.argsort(seq_ids)
            place = order[np.searchsorted(seq_ids, flight.sampler_ids, sorter=order)]
            tokens = tokens[place]
        rows, samplers, ids = flight.rows, flight.samplers, flight.sampler_ids
        gone_ids, gone_tokens = _NO_ROWS, tokens[:0]
        if flight.left:
            gone = np.fromiter(flight.left, np.int64)
            kept = ~np.isin(samplers, gone)
            gone_ids, gone_tokens = ids[~kept], tokens[~kept]
            rows, samplers, tokens = rows[~np.isin(rows, gone)], samplers[kept], tokens[kept]
        self.ahead[samplers] -= 1
        return Landed(rows, samplers, tokens, gone_ids, gone_tokens)

    def deliver(
        self, landed: Landed, waiting: Mapping[int, Seq], on_full: Callable[[Seq], None]
    ) -> list[int]:
        """Append each landed token of a sequence that left its row to it if it waits
        (preempted; ``on_full(seq)`` for each block it fills); returns their ids."""
        delivered = []
        left = zip(landed.left_ids.tolist(), landed.left_tokens.tolist(), strict=True)
        for seq_id, token in left:
            seq = waiting.get(seq_id)
            if seq is None:
                continue  # (ended or aborted: dropped)
            n = seq.n_tokens
            if len(seq.tokens) <= n:
                grown = np.empty(max(16, 2 * len(seq.tokens)), dtype=np.int32)
                grown[:n] = seq.tokens[:n]
                seq.tokens = grown
            seq.tokens[n] = token
            seq.n_tokens = n + 1
            if seq.n_tokens % self.block_size == 0:
                on_full(seq)
            delivered.append(seq_id)
        return delivered

    def fail_in_flight(self) -> tuple[np.ndarray, np.ndarray]:
        """The oldest launched step failed: it and the step launched after it (voided) roll
        back; returns (rows of the failed step, rows of the voided one) still in their rows."""
        failed = self.in_flight.popleft()
        if failed.void:
            return _NO_ROWS, _NO_ROWS
        voided = self.in_flight[0] if self.in_flight else None
        later = _NO_ROWS
        if voided is not None:
            voided.void = True
            later = self._roll_back(voided)
        return self._roll_back(failed), later

    @staticmethod
    def _live(flight: InFlight) -> tuple[np.ndarray, np.ndarray]:
        """(rows, starts) of the step's work whose rows still hold their sequence."""
        rows, starts = flight.rows, flight.starts
        if flight.left:
            kept = ~np.isin(rows, np.fromiter(flight.left, np.int64))
            rows, starts = rows[kept], starts[kept]
        return rows, starts

    def _roll_back(self, flight: InFlight) -> np.ndarray:
        rows, starts = self._live(flight)
        self.computed[rows] = np.minimum(self.computed[rows], starts)
        self.ahead[rows] = 0
        return rows

    def departed(self, row: int) -> None:
        """(``RowTable.deactivate``, overlapped steps) The row's sequence left it."""
        for flight in self.in_flight:
            flight.left.add(row)

    def land_outcome(
        self, e: ev.StepExecuted, waiting: Mapping[int, Seq], seq_full: Callable[[Seq], None]
    ) -> tuple[np.ndarray, np.ndarray]:
        """``StepExecuted``'s fold with overlapped steps: the oldest launched step's outcome
        lands (the preempted sequences' tokens delivered, ``seq_full`` for each block one
        fills); returns (rows, tokens) of the samplers still in their rows, for the caller
        to append."""
        landed = self.land(e.seq_ids, e.tokens)
        if self.failures[landed.rows].any():  # a success resets the count
            self._reset_failures(landed.rows)
        self._landed = self.row_seq[landed.samplers]
        self._delivered = self.deliver(landed, waiting, seq_full)
        return landed.samplers, landed.tokens


__all__ = ["InFlight", "Landed", "PipelinedRows"]
