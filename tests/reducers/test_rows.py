"""The RowTable (``reducers/rows.py``) through the sequence folds: an admission takes the
next free row and fills its columns; a row's loading flag follows the trigger that took it."""

from __future__ import annotations

import numpy as np
import pytest

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
