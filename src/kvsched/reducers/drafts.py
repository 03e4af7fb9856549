"""DraftRows: speculative decoding's part of the sequence table (``SequenceTable`` builds on
it, and its folds call these).

A sampled row may get draft tokens proposed with the outcome (``StepExecuted.drafts``, kept in
``Seq.drafts``); its next decode verifies the first ``DecodeScheduled.num_drafts`` of them
(``drafting``: row -> count, for the pending step), computing their positions after its
newest token. The outcome then brings the tokens the row produced (its accepted drafts and
one more, ``StepExecuted.counts``): they are appended one by one up to the sequence's end,
and the row has computed every token it knows but the newest (the rejected drafts' KV is
stale and is rewritten before it is read). A step consumes the drafts of the rows it
computed; a preemption or an end drops them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvsched.reducers.blocktables import BlockTables
from kvsched.reducers.errors import ReplayMismatch
from kvsched.reducers.seq import NO_DRAFTS


class DraftRows(BlockTables):
    def __init__(self, max_batch: int, max_blocks: int, block_size: int, max_context: int) -> None:
        super().__init__(max_batch, max_blocks, block_size)
        self.max_context = max_context
        # row -> drafts it verifies in the pending step (``Seq.drafts``'s first ones)
        self.drafting: dict[int, int] = {}
        self._any_drafts = False  # (whether drafts were ever proposed: then steps consume them)

    def _schedule_drafts(self, rows: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
        """Each row verifies the first ``num_drafts`` of its drafts (``drafting``)."""
        if len(num_drafts) != len(rows):
            raise ReplayMismatch("draft counts for another number of sequences")
        for row, n in zip(rows.tolist(), num_drafts.tolist(), strict=True):
            seq = self.objs[row]
            assert seq is not None
            if not 0 <= n <= len(seq.drafts):
                raise ReplayMismatch(
                    f"sequence {seq.seq_id}: {n} drafts scheduled, {len(seq.drafts)} proposed"
                )
            if n:
                self.drafting[row] = n
        return num_drafts.astype(np.int64)

    def _append_each(
        self,
        rows: np.ndarray,
        counts: np.ndarray,
        tokens: np.ndarray,
        on_full: Callable[[int], None],
    ) -> None:
        """Append each row's ``counts`` tokens one by one, stopping after the one that ends
        the sequence (eos, its ``max_tokens``th output or the context's last position):
        what follows it was never to be produced. ``on_full(row)``: a block just filled."""
        bs, limit, offset = self.block_size, self.max_context, 0
        for row, n in zip(rows.tolist(), counts.tolist(), strict=True):
            for token in tokens[offset : offset + n].tolist():
                known = int(self.ntokens[row])
                self.tail[row, known % bs] = token
                self.ntokens[row] = known = known + 1
                self.last_token[row] = token
                if known % bs == 0:
                    on_full(row)
                outputs = known - int(self.n_prompt[row])
                if token == self.eos[row] or outputs >= self.max_tokens[row] or known >= limit:
                    break
            offset += n

    def _settle_drafts(self, rows: list[int]) -> None:
        """Rows that verified drafts have computed every token they know but the newest."""
        at = np.asarray(rows, dtype=np.int64)
        self.computed[at] = np.minimum(self.computed[at], self.ntokens[at] - 1)
        for row in rows:
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
        for its next decode are those proposed now (none if none)."""
        for row in computed.tolist():
            seq = self.objs[row]
            assert seq is not None
            seq.drafts = NO_DRAFTS
        if counts is None or drafts is None:
            return
        self._any_drafts = True
        offsets = np.cumsum(counts)
        for i, row in enumerate(rows.tolist()):
            seq = self.objs[row]
            assert seq is not None
            if not counts[i]:
                continue
            proposed = drafts[int(offsets[i] - counts[i]) : int(offsets[i])].copy()
            proposed.flags.writeable = False
            seq.drafts = proposed
