"""policy/common.py: the shared vocabulary of the policy's parts."""

from __future__ import annotations

import numpy as np

from kvsched.policy.common import NO_MATCH, Chunk, StepBudget, arr, cdiv


def test_cdiv_rounds_a_partial_block_up_and_a_whole_one_exactly():
    assert [cdiv(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_arr_makes_int64_arrays_unless_told_another_dtype():
    assert arr([1, 2]).dtype == np.int64
    assert arr([1, 2], np.int32).dtype == np.int32


def test_no_match_serves_no_tokens_from_no_blocks_and_restores_no_checkpoint():
    assert NO_MATCH.num_tokens == 0 and len(NO_MATCH.blocks) == 0
    assert NO_MATCH.ckpt_id == -1 and NO_MATCH.overlap == 0


def test_a_step_budget_counts_tokens_prefills_and_the_chunks_that_do_not_end_a_prompt():
    budget = StepBudget()
    for seq_id, chunk in ((1, Chunk(0, 64, False)), (2, Chunk(16, 40, True))):
        budget.add(seq_id, chunk.start, chunk.end, chunk.final)
    assert (budget.tokens, budget.prefills, budget.long_chunks) == (88, 2, 1)
    assert (budget.seq_ids, budget.starts, budget.ends) == ([1, 2], [0, 16], [64, 40])
