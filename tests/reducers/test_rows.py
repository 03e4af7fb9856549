"""reducers/rows.py: the batch rows of running sequences (their columns, the free list)."""

from __future__ import annotations

import numpy as np
from tests.policy.helpers import Harness, request


def test_each_running_sequence_has_its_own_row_and_rows_of_finds_it():
    h = Harness()
    h.step([request(1, 40), request(2, 20)])
    t = h.state.seqs
    rows = t.rows_of(np.array([2, 1]))
    assert rows.tolist() == [h.state.seq(2).row, h.state.seq(1).row]
    assert t.num_running == 2 and len(set(rows.tolist())) == 2


def test_a_finished_sequence_gives_its_row_back():
    h = Harness(max_batch=2)
    h.step([request(1, 20, max_tokens=1)])
    h.run_until_idle()
    t = h.state.seqs
    assert t.num_running == 0 and sorted(t.free_rows) == [0, 1]


def test_a_rows_blocks_are_its_block_table_up_to_its_block_count():
    h = Harness()
    h.step([request(1, 40)])
    t = h.state.seqs
    row = h.state.seq(1).row
    assert len(t.blocks_of(row)) == int(t.nblocks[row]) == 3
