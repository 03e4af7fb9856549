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


def test_a_flush_grows_the_token_buffer_keeping_every_token_already_there():
    h = Harness()
    h.step([request(1, 40, max_tokens=8)])
    for _ in range(4):
        h.step()
    t = h.state.seqs
    seq = h.state.seq(1)
    prompt = seq.token_view().copy()
    assert len(seq.tokens) == 40 and int(t.ntokens[seq.row]) > 40  # sampled, not flushed
    t.flush(seq.row)
    assert len(seq.tokens) >= 80 and seq.tokens.flags.writeable  # grown into a copy
    assert seq.token_view()[:40].tolist() == prompt.tolist()
    assert seq.n_tokens == int(t.ntokens[seq.row])


def test_a_rows_blocks_are_its_block_table_up_to_its_block_count():
    h = Harness()
    h.step([request(1, 40)])
    t = h.state.seqs
    row = h.state.seq(1).row
    assert len(t.blocks_of(row)) == int(t.nblocks[row]) == 3


def test_a_rows_block_table_is_handed_out_read_only() -> None:
    h = Harness()
    h.step([request(1, 40)])
    t = h.state.seqs
    row = h.state.seq(1).row
    blocks = t.blocks_of(row)
    assert len(blocks) == 3
    with pytest.raises(ValueError, match="read-only"):
        blocks[0] = 0
    with pytest.raises(ValueError, match="read-only"):
        t.block_table(h.state.seq(1))[:] = 0


def test_the_per_row_queries_answer_from_the_columns_and_return_copies() -> None:
    h = Harness()
    h.step([request(1, 40, max_tokens=3), request(2, 20)])
    h.step()  # both prompts computed: each row decodes next
    t = h.state.seqs
    rows = t.rows_of(np.array([1, 2]))
    assert t.ids_at(rows).tolist() == [1, 2]
    assert [s.seq_id for s in t.seqs_at(rows)] == [1, 2] and t.seq_at(int(rows[0])).seq_id == 1
    assert t.computed_of(rows).tolist() == [40, 20] and t.computed_at(int(rows[1])) == 20
    assert t.known_of(rows).tolist() == [41, 21] and t.tokens_left(rows).tolist() == [1, 1]
    assert t.awaiting_decode(rows).tolist() == [True, True]
    assert t.block_counts(rows).tolist() == [3, 2] and t.nblocks_at(int(rows[0])) == 3
    assert t.token_limits(rows).tolist() == [43, 24]
    assert t.outputs_done(rows).tolist() == [False, False]
    assert t.is_eos(rows).tolist() == [False, False]
    # 20 computed tokens fill 1 of sequence 2's 2 blocks: its next position (20) is in block 1
    assert t.rows_needing_blocks(rows).tolist() == []
    assert t.still_held(rows).tolist() == rows.tolist()
    spans = t.blocks_in(rows, np.array([1, 0]), np.array([3, 1]))
    own = [t.blocks_of(int(rows[0]))[1:3], t.blocks_of(int(rows[1]))[:1]]
    assert spans.tolist() == np.concatenate(own).tolist() and spans.flags.writeable
    for answer in (t.ids_at(rows), t.computed_of(rows), t.tokens_left(rows)):
        answer[:] = -1  # a copy: the columns do not change
    assert t.ids_at(rows).tolist() == [1, 2] and t.computed_of(rows).tolist() == [40, 20]


def test_rows_to_cache_names_each_rows_computed_full_blocks_not_yet_indexed() -> None:
    h = Harness()
    h.step([request(1, 40)])
    t = h.state.seqs
    row = h.state.seq(1).row
    grown, first, last = t.rows_to_cache()
    assert (grown.tolist(), first.tolist(), last.tolist()) == ([], [], [])  # none computed
    h.step()  # 40 tokens computed: blocks 0 and 1 are full and were cached after the step
    assert t.registered_at(row) == 2
    assert t.rows_to_cache(np.array([row]))[0].tolist() == []
    assert t.rows_to_save(np.array([row])).tolist() == [row] and t.saved_at(row) == 0
