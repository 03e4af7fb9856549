"""DraftRows: speculative decoding's part of the sequence table (``SequenceTable`` builds on
it, and its folds call these).

A sampled row may get draft tokens proposed with the outcome (``StepExecuted.drafts``); the
first ``max_drafts`` of them are kept in the row (``draft_ids``, ``ndrafts``: the rest can
never be verified). Its next decode verifies the first ``DecodeScheduled.num_drafts`` of them
(``verifying``, for the pending step), computing their positions after its newest token. The
outcome then brings the tokens the row produced (its accepted drafts and one more,
``StepExecuted.counts``): they are appended up to the sequence's end, and the row has computed
every token it knows but the newest (the rejected drafts' KV is stale and is rewritten before
it is read). A step consumes the drafts of the rows it computed; a preemption, a failed step
or an end drops them. Everything is kept in row arrays, so a step's drafts fold without a
loop over its rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvsched.reducers.blocktables import BlockTables
from kvsched.reducers.errors import ReplayMismatch


def within_runs(counts: np.ndarray) -> np.ndarray:
    """0..n-1 for each count n, concatenated (a token's place within its row's run)."""
    starts = np.cumsum(counts) - counts
    places: np.ndarray = np.arange(int(counts.sum())) - np.repeat(starts, counts)
    return places


class DraftRows(BlockTables):
    def __init__(
        self, max_batch: int, max_blocks: int, block_size: int, max_context: int, max_drafts: int
    ) -> None:
        super().__init__(max_batch, max_blocks, block_size)
        self.max_context = max_context
        self.max_drafts = max_drafts  # drafts kept per row (``speculation.max_drafts``)
        self.draft_ids = np.zeros((max_batch, max_drafts), dtype=np.int32)
        self.ndrafts = np.zeros(max_batch, dtype=np.int32)  # drafts kept per row
        self.verifying = np.zeros(max_batch, dtype=np.int32)  # drafts verified, pending step
        self.any_verifying = False
        self.freed_columns.append(self.ndrafts)  # (a row freed drops its drafts)

    def drafts_of(self, rows: np.ndarray) -> np.ndarray:
        """How many draft tokens are proposed for each row's next decode."""
        proposed: np.ndarray = self.ndrafts[rows].astype(np.int64)
        return proposed

    def verifying_of(self, rows: np.ndarray) -> np.ndarray:
        """How many drafts each row verifies in the pending step."""
        if not self.any_verifying:
            return np.zeros(len(rows), dtype=np.int32)
        verifying: np.ndarray = self.verifying[rows]
        return verifying

    def draft_tokens(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The first ``counts`` drafts of each row, concatenated."""
        tokens: np.ndarray = self.draft_ids[np.repeat(rows, counts), within_runs(counts)]
        return tokens

    def _schedule_drafts(self, rows: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
        """Each row verifies the first ``num_drafts`` of its drafts (``verifying``)."""
        if len(num_drafts) != len(rows):
            raise ReplayMismatch("draft counts for another number of sequences")
        bad = (num_drafts < 0) | (num_drafts > self.ndrafts[rows])
        if bad.any():
            i = int(np.argmax(bad))
            raise ReplayMismatch(
                f"sequence {int(self.row_seq[rows[i]])}: {int(num_drafts[i])} drafts scheduled,"
                f" {int(self.ndrafts[rows[i]])} proposed"
            )
        self.verifying[rows] = num_drafts
        self.any_verifying = self.any_verifying or bool(num_drafts.any())
        return num_drafts.astype(np.int64)

    def _append_each(
        self,
        rows: np.ndarray,
        counts: np.ndarray,
        tokens: np.ndarray,
        on_full: Callable[[int], None],
    ) -> None:
        """Append each row's ``counts`` tokens, stopping after the one that ends the
        sequence (eos, its ``max_tokens``th output or the context's last position): what
        follows it was never to be produced. ``on_full(row)``: a block just filled. Rows
        whose tokens stay within their tail block append together; a row that crosses into
        a new block appends token by token (its full block is flushed first)."""
        bs, index = self.block_size, np.repeat(np.arange(len(rows)), counts)
        at, first = rows[index], np.cumsum(counts) - counts
        known = self.ntokens[at] + within_runs(counts) + 1  # tokens known once each is appended
        ends = (
            (tokens == self.eos[at])
            | (known - self.n_prompt[at] >= self.max_tokens[at])
            | (known >= self.max_context)
        )
        before = np.cumsum(ends) - ends  # a token is kept unless an earlier one of its row
        kept = before == np.repeat(before[first], counts)  # ended the sequence
        nkept = np.bincount(index[kept], minlength=len(rows))
        crossing = kept & ((known - 1) // bs != self.ntokens[at] // bs)
        slow = np.bincount(index[crossing], minlength=len(rows)) > 0
        fast = kept & ~slow[index]
        self.tail[at[fast], (known[fast] - 1) % bs] = tokens[fast]
        quick = rows[~slow]
        self.ntokens[quick] += nkept[~slow]
        self.last_token[quick] = tokens[first[~slow] + nkept[~slow] - 1]
        for row in quick[self.ntokens[quick] % bs == 0].tolist():
            on_full(row)
        for i in np.nonzero(slow)[0].tolist():
            row = int(rows[i])
            for token in tokens[first[i] : first[i] + nkept[i]].tolist():
                n = int(self.ntokens[row])
                self.tail[row, n % bs] = token
                self.ntokens[row] = n + 1
                self.last_token[row] = token
                if (n + 1) % bs == 0:
                    on_full(row)

    def _end_verifying(self) -> np.ndarray:
        """The rows that verify drafts in the pending step, which ends now."""
        (at,) = np.nonzero(self.verifying)
        self.verifying[at] = 0
        self.any_verifying = False
        return at

    def _settle_drafts(self, rows: np.ndarray, experts: bool) -> None:
        """Rows that verified drafts have computed every token they know but the newest
        (``experts``: the step recorded routed experts, kept for computed tokens only)."""
        self.computed[rows] = np.minimum(self.computed[rows], self.ntokens[rows] - 1)
        if experts:
            for row in rows.tolist():
                seq = self.objs[row]
                assert seq is not None
                seq.n_experts = min(seq.n_experts, int(self.computed[row]))

    def _take_drafts(
        self,
        computed: np.ndarray,
        rows: np.ndarray,
        counts: np.ndarray | None,
        drafts: np.ndarray | None,
    ) -> None:
        """The step consumed the drafts of the rows it computed; each sampled row's drafts
        for its next decode are the first ``max_drafts`` of those proposed now (none if
        none)."""
        self.ndrafts[computed] = 0
        if counts is None or drafts is None or not self.max_drafts:
            return
        keep = np.minimum(counts, self.max_drafts)
        within = within_runs(keep)
        first = np.repeat(np.cumsum(counts) - counts, keep)
        self.draft_ids[np.repeat(rows, keep), within] = drafts[first + within]
        self.ndrafts[rows] = keep

    def _drop_drafts(self, rows: np.ndarray) -> None:
        """The rows' drafts are dropped (a failed step: a retry decodes without them)."""
        self.ndrafts[rows] = 0
        self._end_verifying()

