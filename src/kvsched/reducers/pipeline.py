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

Speculative decoding with overlapped steps (vLLM's ``AsyncScheduler``): the drafts a decode
verifies are placeholders too (input ids -1; the executor fills in its own proposals, as
vLLM's runner does). A launched sampler counts one placeholder for its token and one for each
draft it verifies (``ahead``, vLLM's ``num_output_placeholders``; ``ahead_drafts`` of them
drafts, so a row's sure tokens are ``ntokens + ahead - ahead_drafts``), and is given
``max_drafts`` placeholder drafts for its next decode. Its outcome brings the accepted drafts
and one more token; the rejected ones roll back its computed tokens and shift the starts of
its work in the step launched after it (the executor writes that work right after the tokens
that were accepted, as vLLM's runner does).

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
from kvsched.reducers.drafts import DraftRows, within_runs
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
    drafts: np.ndarray  # the drafts each sampler verifies (placeholders)
    left: set[int] = attrs.field(factory=set)  # rows freed since the launch
    void: bool = False  # planned on a step that failed: its outcome is dropped
    # (``cache_when_planned``) per row, the blocks its work was to write that entered the
    # prefix index at planning: (depth, block, hash)
    cached: dict[int, list[tuple[int, int, bytes]]] = attrs.field(factory=dict)


@attrs.frozen
class Landed:
    """What an outcome lands: the rows its step computed and those that sampled (still
    holding their sequences), their tokens (``counts`` each); the sequences that left their
    rows since the launch (preempted, ended) and their tokens (``left_counts`` each)."""

    rows: np.ndarray
    samplers: np.ndarray
    tokens: np.ndarray
    counts: np.ndarray
    drafts: np.ndarray  # the drafts each sampler verified
    left_ids: np.ndarray
    left_tokens: np.ndarray
    left_counts: np.ndarray


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
        self.ahead_drafts = np.zeros(max_batch, dtype=np.int64)  # of which drafts
        # (a row freed drops its placeholders)
        self.freed_columns += [self.ahead, self.ahead_drafts]
        self.in_flight: deque[InFlight] = deque()
        self.departed_unwritten: list[tuple[int, int, bytes]] = []  # (fail_in_flight)
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

    def flight_starts(self) -> dict[int, int]:
        """Row -> where the earliest work of it still in flight starts (rows in no launched
        step are absent)."""
        out: dict[int, int] = {}
        for flight in self.in_flight:
            rows, starts = self._live(flight)
            for row, start in zip(rows.tolist(), starts.tolist(), strict=True):
                out[row] = min(start, out.get(row, start))
        return out

    def placeholders_of(self, seq_ids: np.ndarray) -> np.ndarray:
        """Each running sequence's placeholders: its tokens and verified drafts still out
        (vLLM's ``num_output_placeholders``; zeros without overlapped steps)."""
        if not self.in_flight:
            return np.zeros(len(seq_ids), np.int64)
        return self.ahead[self.rows_of(seq_ids)]  # type: ignore[no-any-return]

    def entries_of(self, seq_ids: np.ndarray) -> np.ndarray:
        """When each running sequence took its row (a stamp: larger is later; vLLM's order
        of its running list, where a request is appended when it is scheduled)."""
        return self.entered[self.rows_of(seq_ids)]  # type: ignore[no-any-return]

    def late_states(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(overlapped steps) Of decoding ``rows`` whose newest position is a placeholder,
        those whose step in flight decodes to a state that known tokens name (every token it
        hashes has landed), and that state's token count: it sits in their runtime slot
        until their next forward."""
        late = rows[self.ahead[rows] > 0]
        reached = self.computed[late]
        named = (reached <= self.ntokens[late]) & (reached > self.n_prompt[late])
        return late[named], reached[named]

    def not_at_end(self, rows: np.ndarray) -> np.ndarray:
        """(overlapped steps) Those of ``rows`` not at their end once their placeholders'
        tokens land, even if every draft in flight is rejected (``max_tokens``, the context):
        those at their end are not scheduled again (vLLM's rule)."""
        known = self.ntokens[rows] + self.ahead[rows] - self.ahead_drafts[rows]
        done = (known - self.n_prompt[rows] >= self.max_tokens[rows]) | (known >= self.max_context)
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

    def written_blocks(self, rows: np.ndarray) -> np.ndarray:
        """Each row's leading indexed blocks whose KV is written: with overlapped steps
        (blocks indexed at planning under ``cache_when_planned``) not those a step in flight
        writes."""
        if not self.pipelined:
            return super().written_blocks(rows)
        written: np.ndarray = np.minimum(
            self.registered[rows], self.cacheable()[rows] // self.block_size
        )
        return written

    @property
    def awaiting_outcomes(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(step, expected sampler ids, the drafts each verifies) of each step whose outcome
        is owed, oldest first: the launched ones, then the pending one (launched when the
        next step starts)."""
        owed = [(f.step, f.sampler_ids, f.drafts) for f in self.in_flight]
        if self.has_pending:
            rows, _, ends = self.pending_arrays()
            samplers = rows[ends >= self.planned_known(rows)]
            drafts = self.verifying[samplers] if self.any_verifying else np.zeros_like(samplers)
            owed.append((self.pending_step, self.row_seq[samplers], drafts))
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
        count, drafts = np.zeros_like(self.ahead), np.zeros_like(self.ahead)
        for flight in filter(lambda f: not f.void, self.in_flight):
            left = np.isin(flight.samplers, list(flight.left))
            count[flight.samplers[~left]] += 1 + flight.drafts[~left]
            drafts[flight.samplers[~left]] += flight.drafts[~left]
            gone = flight.sampler_ids[left]
            if np.isin(gone, self.row_seq).any():
                return f"a sequence of {gone.tolist()} runs again before its token lands"
        if not np.array_equal(count, self.ahead) or not np.array_equal(drafts, self.ahead_drafts):
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
        """The pending step goes out (the next step starts before its outcome lands): each
        sampler counts its placeholders and, with speculative decoding, gets ``max_drafts``
        placeholder drafts for its next decode (the step consumed the ones it verified)."""
        if not self.has_pending:
            return
        rows, starts, ends = self.pending_arrays()
        samplers = rows[ends >= self.planned_known(rows)]
        drafts = self.verifying_of(samplers).astype(np.int64)
        if self.any_verifying:
            self._end_verifying()
        self.computed[rows] = ends
        self.ahead[samplers] += 1 + drafts
        self.ahead_drafts[samplers] += drafts
        if self.max_drafts:
            self.ndrafts[rows] = 0
            self.ndrafts[samplers] = self.max_drafts
            self.draft_ids[samplers] = -1
        ids = self.row_seq[samplers].copy()
        flight = InFlight(self.pending_step, rows, starts, samplers, ids, drafts)
        flight.cached = self._cached_unwritten(rows, starts)
        self.in_flight.append(flight)
        self.clear_pending()

    def _cached_unwritten(
        self, rows: np.ndarray, starts: np.ndarray
    ) -> dict[int, list[tuple[int, int, bytes]]]:
        """Per row, the blocks from its work's start on that are in the prefix index already
        (cached when planned): unwritten until the step lands."""
        firsts = starts // self.block_size
        some = self.registered[rows] > firsts  # (most decodes fill no block: none)
        pairs = zip(rows[some].tolist(), firsts[some].tolist(), strict=True)
        return {row: self.indexed_from(row, first) for row, first in pairs}

    def land(self, e: ev.StepExecuted) -> Landed:
        """The oldest launched step's outcome, its samplers' placeholders taken off (the
        caller appends the tokens, then settles the drafts: ``settle_landed``). A voided
        step lands nothing."""
        flight = self.in_flight.popleft()
        tokens = e.tokens
        counts = np.ones(len(e.seq_ids), np.int64) if e.counts is None else e.counts
        if flight.void:
            none = _NO_ROWS
            return Landed(none, none, tokens[:0], none, none, none, tokens[:0], none)
        if not np.array_equal(e.seq_ids, flight.sampler_ids):  # (plan order: the common case)
            order = np.argsort(e.seq_ids)
            place = order[np.searchsorted(e.seq_ids, flight.sampler_ids, sorter=order)]
            tokens, counts = _ragged_take(tokens, counts, place), counts[place]
        rows, samplers, ids = flight.rows, flight.samplers, flight.sampler_ids
        drafts = flight.drafts
        gone_ids, gone_tokens, gone_counts = _NO_ROWS, tokens[:0], _NO_ROWS
        if flight.left:
            gone = np.fromiter(flight.left, np.int64)
            kept = ~np.isin(samplers, gone)
            each = np.repeat(kept, counts)
            gone_ids, gone_tokens, gone_counts = ids[~kept], tokens[~each], counts[~kept]
            rows = rows[~np.isin(rows, gone)]
            samplers, tokens, counts = samplers[kept], tokens[each], counts[kept]
            drafts = drafts[kept]
        self.ahead[samplers] -= 1 + drafts
        self.ahead_drafts[samplers] -= drafts
        return Landed(rows, samplers, tokens, counts, drafts, gone_ids, gone_tokens, gone_counts)

    def settle_landed(self, rows: np.ndarray, drafts: np.ndarray, before: np.ndarray) -> None:
        """(drafts) Rows whose outcome landed, ``before`` their tokens were appended: the
        positions of the drafts they verified past the tokens they kept are not computed
        (rejected, or past the sequence's end), and the work of the step launched after
        theirs starts that much earlier."""
        uncomputed = 1 + drafts - (self.ntokens[rows] - before)
        if uncomputed.any():
            self._reject(rows, uncomputed)

    def _reject(self, samplers: np.ndarray, rejected: np.ndarray) -> None:
        """Rejected drafts: their positions are not computed, and the work of the step
        launched after this one starts that much earlier (the executor writes it after the
        accepted tokens)."""
        self.computed[samplers] -= rejected
        shift = np.zeros(len(self.ahead), np.int64)
        shift[samplers] = rejected
        for flight in self.in_flight:
            live = ~np.isin(flight.rows, np.fromiter(flight.left, np.int64))
            flight.starts = flight.starts - np.where(live, shift[flight.rows], 0)

    def deliver(
        self, landed: Landed, waiting: Mapping[int, Seq], on_full: Callable[[Seq], None]
    ) -> list[int]:
        """Append the landed tokens of each sequence that left its row to it if it waits
        (preempted; ``on_full(seq)`` for each block it fills), up to its end (eos,
        ``max_tokens``, the context: what follows was never to be produced); returns their
        ids."""
        delivered = []
        firsts = (np.cumsum(landed.left_counts) - landed.left_counts).tolist()
        for seq_id, first, count in zip(
            landed.left_ids.tolist(), firsts, landed.left_counts.tolist(), strict=True
        ):
            seq = waiting.get(seq_id)
            if seq is None:
                continue  # (ended or aborted: dropped)
            for token in landed.left_tokens[first : first + count].tolist():
                self._append_to(seq, token, on_full)
                if _ends(seq, token, self.max_context):
                    break
            delivered.append(seq_id)
        return delivered

    def _append_to(self, seq: Seq, token: int, on_full: Callable[[Seq], None]) -> None:
        n = seq.n_tokens
        if len(seq.tokens) <= n:
            grown = np.empty(max(16, 2 * len(seq.tokens)), dtype=np.int32)
            grown[:n] = seq.tokens[:n]
            seq.tokens = grown
        seq.tokens[n] = token
        seq.n_tokens = n + 1
        if seq.n_tokens % self.block_size == 0:
            on_full(seq)

    def fail_in_flight(self) -> tuple[np.ndarray, np.ndarray]:
        """The oldest launched step failed: it and the step launched after it (voided) roll
        back; returns (rows of the failed step, rows of the voided one) still in their rows.
        The blocks the two cached at planning for sequences that left their rows since are
        kept for the recovery (``unwritten_of_departed``): nothing wrote them."""
        failed = self.in_flight.popleft()
        self.departed_unwritten = []
        if failed.void:
            return _NO_ROWS, _NO_ROWS
        voided = self.in_flight[0] if self.in_flight else None
        later = _NO_ROWS
        for flight in (failed, voided) if voided is not None else (failed,):
            for row in sorted(flight.left):
                self.departed_unwritten += flight.cached.get(row, [])
        if voided is not None:
            voided.void = True
            later = self._roll_back(voided)
        return self._roll_back(failed), later

    def cached_after_launch(self, rows: np.ndarray, starts: np.ndarray) -> None:
        """Under ``cache_when_planned`` a block a launched step writes is cached once its
        tokens are known, maybe after the launch (the token that fills it landed since):
        each step in flight that works on the row records the blocks from its work's start
        on, so its failure takes them back like those cached at its planning."""
        if not self.cache_when_planned or not self.in_flight:
            return
        bs = self.block_size
        for flight in self.in_flight:
            if flight.void:
                continue
            live, work_starts = self._live(flight)
            for row, first in zip(rows.tolist(), starts.tolist(), strict=True):
                at = np.flatnonzero(live == row)
                if len(at):
                    lo = max(first, int(work_starts[at[0]]) // bs)
                    flight.cached.setdefault(row, []).extend(self.indexed_from(row, lo))

    def unwritten_of_departed(self) -> list[tuple[int, int, bytes]]:
        """(depth, block, hash) of the blocks the latest failed step (and the step voided
        with it) cached at planning for sequences that had left their rows (a copy)."""
        return list(self.departed_unwritten)

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
        self.ahead_drafts[rows] = 0
        return rows

    def departed(self, row: int) -> None:
        """(``RowTable.deactivate``, overlapped steps) The row's sequence left it."""
        for flight in self.in_flight:
            flight.left.add(row)

    def land_outcome(
        self, e: ev.StepExecuted, waiting: Mapping[int, Seq], seq_full: Callable[[Seq], None]
    ) -> Landed:
        """``StepExecuted``'s fold with overlapped steps: the oldest launched step's outcome
        lands (the preempted sequences' tokens delivered, ``seq_full`` for each block one
        fills); returns it: the caller appends the tokens of the samplers still in their rows
        and settles their drafts (``settle_landed``)."""
        landed = self.land(e)
        if self.failures[landed.rows].any():  # a success resets the count
            self._reset_failures(landed.rows)
        self._landed = self.row_seq[landed.samplers]
        self._delivered = self.deliver(landed, waiting, seq_full)
        return landed


def _ragged_take(tokens: np.ndarray, counts: np.ndarray, place: np.ndarray) -> np.ndarray:
    """The runs of ``tokens`` (``counts`` each) in the order ``place``."""
    if len(tokens) == len(counts):
        return tokens[place]  # type: ignore[no-any-return]
    firsts = np.cumsum(counts) - counts
    taken = counts[place]
    return tokens[np.repeat(firsts[place], taken) + within_runs(taken)]  # type: ignore[no-any-return]


def _ends(seq: Seq, token: int, max_context: int) -> bool:
    """Whether the sequence's newest token (``token``) ends it."""
    n = seq.n_tokens
    return token == seq.eos_token_id or n - seq.n_prompt >= seq.max_tokens or n >= max_context


__all__ = ["InFlight", "Landed", "PipelinedRows"]
