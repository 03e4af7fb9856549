"""policy/common.py: the shared vocabulary of the policy's parts."""

from __future__ import annotations

from kvsched.policy.common import NO_MATCH, cdiv


def test_cdiv_rounds_a_partial_block_up_and_a_whole_one_exactly():
    assert [cdiv(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_no_match_serves_no_tokens_from_no_blocks_and_restores_no_checkpoint():
    assert NO_MATCH.num_tokens == 0 and len(NO_MATCH.blocks) == 0
    assert NO_MATCH.ckpt_id == -1 and NO_MATCH.overlap == 0
