"""reducers/rows.py: the batch rows of running sequences (their columns, the free list); an
admission takes the next free row and fills its columns; a row's loading flag follows the
event that took it."""

from __future__ import annotations

import numpy as np
import pytest
from tests.policy.helpers import Harness, request

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.events import types as ev
from kvsched.reducers.errors import ReplayMismatch
from kvsched.reducers.state import EngineState


def _state() -> EngineState:
    model = ModelSpec(vocab_size=100, max_context=512)
    return EngineState(SchedulerConfig(model=model, block_size=16, num_blocks=64, max_batch=4))


def _arrive(state: EngineState, seq_id: int, n: int) -> None:
    prompt = np.arange(1, n + 1, dtype=np.int32) % 97 + 1
    state.apply(ev.RequestArrived(seq_id, prompt, 4))


def test_an_admission_takes_the_next_free_row_and_fills_its_columns() -> None:
    state = _state()
    state.apply(ev.StepStarted(1, 0.0))
    _arrive(state, 7, 20)
    rows = state.seqs
    row = rows.peek_free_row()
    state.apply(ev.SequenceAdmitted(7, row))
    assert rows.row_seq[row] == 7 and rows.ntokens[row] == 20 and rows.n_prompt[row] == 20
    assert not rows.loading[row]  # admitted to compute, not to load
    assert rows.peek_free_row() != row


def test_an_admission_to_a_row_that_is_not_the_next_free_one_is_a_replay_mismatch() -> None:
    state = _state()
    state.apply(ev.StepStarted(1, 0.0))
    _arrive(state, 1, 8)
    wrong = state.seqs.peek_free_row() + 1
    with pytest.raises(ReplayMismatch):
        state.apply(ev.SequenceAdmitted(1, wrong))


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
