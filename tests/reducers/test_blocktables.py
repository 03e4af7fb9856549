"""reducers/blocktables.py: the block-table folds' queries: live sequences by id, the waiting
queue and the latest failed step's sequences, each handed out so it cannot change the table."""

from __future__ import annotations

import numpy as np
import pytest
from tests.policy.helpers import Harness, request

from kvsched.events import types as ev
from kvsched.reducers.errors import ReplayMismatch


def test_a_live_sequence_is_found_by_id_and_an_unknown_one_is_not() -> None:
    h = Harness()
    h.step([request(1, 40)])
    t = h.state.seqs
    found = t.find(1)
    assert found is not None and found is t.seq(1) and t.is_live(1)
    assert t.find(9) is None and not t.is_live(9)
    with pytest.raises(ReplayMismatch, match="not live"):
        t.seq(9)


def test_the_waiting_queue_is_offered_in_arrival_order_as_a_view() -> None:
    h = Harness(max_batch=1)
    h.step([request(1, 20), request(2, 20), request(3, 20)])
    t = h.state.seqs
    waiting = t.waiting_seqs()
    assert [s.seq_id for s in waiting] == [2, 3] and t.has_waiting
    assert not hasattr(waiting, "pop") and not hasattr(waiting, "clear")  # no way to change it


def test_the_failed_steps_sequences_are_handed_out_as_a_copy() -> None:
    h = Harness()
    h.step([request(1, 20)])
    h.outcome = [ev.StepFailed(h.results[-1].plan.step, "boom")]
    h.step()
    t = h.state.seqs
    failed = t.failed_ids()
    assert failed == [1]
    failed.clear()
    assert t.failed_ids() == [1]


def test_a_sequences_block_table_cannot_be_written_through() -> None:
    h = Harness()
    h.step([request(1, 40)])
    table = h.state.seqs.block_table(h.state.seq(1))
    assert table.dtype == np.int32 and not table.flags.writeable
