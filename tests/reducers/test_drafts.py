"""reducers/drafts.py: a verified row's produced tokens are appended together, exactly as one
at a time up to the sequence's end (eos, ``max_tokens``, the context), blocks filled on the
way included; proposals are kept up to ``max_drafts`` per row and consumed by the next step."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.events import types as ev
from kvsched.reducers.drafts import DraftRows, within_runs
from kvsched.reducers.seq import Seq

BS, CONTEXT, BATCH = 4, 40, 6


def _table(rows: list[tuple[int, int, int, int]]) -> DraftRows:
    """A table whose rows hold sequences of (known tokens, prompt, max_tokens, eos)."""
    table = DraftRows(BATCH, CONTEXT // BS + 1, BS, CONTEXT, max_drafts=3)
    for seq_id, (known, prompt, max_tokens, eos) in enumerate(rows):
        tokens = np.arange(1, known + 1, dtype=np.int32) % 7 + 1
        seq = Seq(seq_id, tokens, known, prompt, max_tokens, 0.0, eos_token_id=eos)
        table.activate(seq, table.free_rows[-1], ev.SequenceAdmitted(seq_id, 0))
    return table


def _one_at_a_time(table: DraftRows, rows: list[int], counts: list[int], tokens: list[int]):
    """The specification: each row's tokens appended singly, stopping after the one that
    ends the sequence; the rows whose blocks filled, in order per row."""
    filled, offset = [], 0
    for row, n in zip(rows, counts, strict=True):
        for token in tokens[offset : offset + n]:
            known = int(table.ntokens[row])
            table.tail[row, known % BS] = token
            table.ntokens[row] = known = known + 1
            table.last_token[row] = token
            if known % BS == 0:
                filled.append(row)
                table.flush(row)
            if (
                token == table.eos[row]
                or known - table.n_prompt[row] >= table.max_tokens[row]
                or known >= CONTEXT
            ):
                break
        offset += n
    return filled


@st.composite
def _appends(draw: st.DrawFn):
    n = draw(st.integers(1, BATCH))
    seqs = []
    for _ in range(n):
        known = draw(st.integers(1, CONTEXT - 1))
        prompt = draw(st.integers(1, known))
        max_tokens = draw(st.integers(known - prompt + 1, CONTEXT))
        seqs.append((known, prompt, max_tokens, draw(st.sampled_from([-1, 5, 6]))))
    counts = [draw(st.integers(1, 4)) for _ in range(n)]
    tokens = draw(st.lists(st.integers(1, 8), min_size=sum(counts), max_size=sum(counts)))
    return seqs, counts, tokens


@settings(max_examples=300, deadline=None)
@given(_appends())
def test_appending_rows_tokens_together_equals_appending_them_one_at_a_time(case) -> None:
    seqs, counts, tokens = case
    mine, spec = _table(seqs), _table(seqs)
    rows = np.asarray([s.row for s in mine.objs if s is not None], dtype=np.int64)
    filled: list[int] = []

    def on_full(row: int) -> None:
        filled.append(row)
        mine.flush(row)

    mine._append_each(rows, np.asarray(counts), np.asarray(tokens, np.int32), on_full)
    expected = _one_at_a_time(spec, rows.tolist(), counts, tokens)
    assert sorted(filled) == sorted(expected)
    assert mine.ntokens.tolist() == spec.ntokens.tolist()
    assert mine.last_token.tolist() == spec.last_token.tolist()
    for row in rows.tolist():
        assert mine.flush(row).token_view().tolist() == spec.flush(row).token_view().tolist()


def test_a_row_keeps_at_most_max_drafts_proposals_and_a_computed_row_loses_them() -> None:
    table = _table([(5, 5, 10, -1), (6, 6, 10, -1)])
    rows = np.asarray([s.row for s in table.objs if s is not None], dtype=np.int64)
    proposals = np.asarray([11, 12, 13, 14, 21], np.int32)
    table._take_drafts(rows[:0], rows, np.asarray([4, 1]), proposals)
    assert table.drafts_of(rows).tolist() == [3, 1]
    assert table.draft_tokens(rows, np.asarray([3, 1])).tolist() == [11, 12, 13, 21]
    table._take_drafts(rows[:1], rows[:0], None, None)  # (the first row computed, nothing new)
    assert table.drafts_of(rows).tolist() == [0, 1]


def test_within_runs_numbers_each_runs_items_from_zero() -> None:
    assert within_runs(np.asarray([2, 0, 3])).tolist() == [0, 1, 0, 1, 2]
