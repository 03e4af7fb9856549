"""SequenceTable: lifecycle, tokens and block tables; its queries change nothing."""

from __future__ import annotations

import numpy as np
import pytest
from tests.policy.helpers import Harness, request

from kvsched.events import types as ev
from kvsched.reducers.errors import ReplayMismatch


def _decoding(h: Harness, steps: int = 6) -> int:
    h.step([request(0, 40, max_tokens=30)])
    for _ in range(steps):
        h.step()
    return 0


def test_an_arrival_is_computed_by_a_query_that_changes_nothing() -> None:
    h = Harness()
    before = h.state.snapshot()
    arrival = h.state.seqs.arrival(request(5, 40))
    assert len(arrival.seq.tokens) == 40 and len(arrival.seq.hashes) == 40 // 16
    assert arrival.top is not None and arrival.top < 1000
    assert h.state.snapshot() == before


def test_the_fold_takes_the_arrival_its_check_computed() -> None:
    h = Harness()
    e = request(5, 40)
    arrival = h.state.seqs.arrival(e)
    h.state.apply(e, arrival)
    assert h.state.seqs.seqs[5] is arrival.seq
    other = Harness()
    other.state.apply(e)  # the same fold, hashing itself
    assert other.state.snapshot() == h.state.snapshot()


def test_a_checkpoint_identity_query_leaves_the_sequences_tokens_unflushed() -> None:
    h = Harness()
    _decoding(h)
    seqs = h.state.seqs
    seq = seqs.seqs[0]
    n = seqs.num_tokens(seq)
    assert n > seq.n_tokens
    before = h.state.snapshot()
    key, anchor = seqs.identity_at(seq, n)
    assert h.state.snapshot() == before and seq.n_tokens < n
    seqs.flush(seq.row)  # the same identity once the tokens are copied in
    assert seqs.identity_at(seq, n) == (key, anchor)


def test_the_rows_of_an_outcomes_samplers_are_a_query() -> None:
    h = Harness()
    h.step([request(0, 20, max_tokens=30), request(1, 20, max_tokens=30)])
    h.step()
    (outcome,) = h.outcome
    assert isinstance(outcome, ev.StepExecuted)
    h.state.apply(outcome)
    rows = h.state.seqs.rows_of(outcome.seq_ids)
    assert h.state.seqs.row_seq[rows].tolist() == outcome.seq_ids.tolist()
    assert not hasattr(h.state.seqs, "sampled_rows")  # (no value left behind by the fold)


def test_a_sequence_that_ends_holding_blocks_is_refused_naming_the_release() -> None:
    h = Harness()
    _decoding(h, 2)
    finished = ev.SequenceFinished(np.array([0]), ("stop",))
    with pytest.raises(ReplayMismatch, match="BlocksFreed and CheckpointUnpinned must come"):
        h.state.apply(finished)


def test_a_prefix_match_of_a_sequence_that_is_not_loading_without_a_row_is_refused() -> None:
    h = Harness()
    h.state.apply(request(0, 40))  # waiting: no row, no load
    match = ev.PrefixMatched(0, np.zeros(0, dtype=np.int32), 0, 0)
    with pytest.raises(ReplayMismatch, match="prefix match outside admission"):
        h.state.apply(match)
