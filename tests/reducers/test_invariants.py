"""reducers/invariants.py: the cross-owner checks, which name the first violation."""

from __future__ import annotations

import pytest
from tests.policy.helpers import Harness, request

from kvsched.reducers.errors import InvariantError
from kvsched.reducers.invariants import check_all


def test_a_consistent_engine_passes_every_check():
    h = Harness()
    h.step([request(1, 40), request(2, 20)])
    check_all(h.state)


def test_a_row_that_is_both_used_and_free_is_named():
    h = Harness()
    h.step([request(1, 40)])
    t = h.state.seqs
    t.free_rows.append(int(t.running_rows()[0]))
    with pytest.raises(InvariantError, match="partitioned"):
        check_all(h.state)


def test_a_waiting_sequence_that_holds_a_row_is_named():
    h = Harness(max_batch=1)
    h.step([request(1, 40), request(2, 40)])
    h.state.seq(2).row = 0
    with pytest.raises(InvariantError, match="waiting sequence 2"):
        check_all(h.state)
