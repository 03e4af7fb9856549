"""replay/synth.py: Mooncake's prompt tokens, synthesised per hash id."""

from __future__ import annotations

import numpy as np

from kvsched.replay.synth import MOONCAKE_BLOCK, BlockTokens, sequential_ideal, synth_tokens


def test_token_j_of_an_id_depends_on_the_id_and_j_only_never_on_the_other_ids():
    alone = synth_tokens(np.array([5], dtype=np.uint64), 8, 1000)
    among = synth_tokens(np.array([3, 5, 9], dtype=np.uint64), 8, 1000)
    assert np.array_equal(alone[0], among[1])
    assert not np.array_equal(among[0], among[1])


def test_synthesised_tokens_lie_in_1_to_vocab_size():
    out = synth_tokens(np.arange(50, dtype=np.uint64), 64, 7)
    assert out.min() >= 1 and out.max() < 7


def test_two_prompts_share_exactly_the_blocks_their_ids_share():
    blocks = BlockTokens(vocab_size=1000, seed=0)
    a = blocks.prompt([1, 2, 3], 2 * MOONCAKE_BLOCK + 10)
    b = blocks.prompt([1, 2, 4], 3 * MOONCAKE_BLOCK)
    assert np.array_equal(a[: 2 * MOONCAKE_BLOCK], b[: 2 * MOONCAKE_BLOCK])
    assert len(a) == 2 * MOONCAKE_BLOCK + 10
    assert not np.array_equal(a[-10:], b[2 * MOONCAKE_BLOCK : 2 * MOONCAKE_BLOCK + 10])


def test_the_ideal_hit_rate_counts_the_prefix_seen_before_in_whole_blocks_never_the_last_token():
    n = 2 * MOONCAKE_BLOCK
    assert sequential_ideal([[1, 2], [1, 2]], [n, n], 64) == (n - 64) / (2 * n)
    assert sequential_ideal([], [], 64) == 0.0
