"""kvsched's state slots as vLLM mamba blocks: the lists the model runner's copy rule turns
into kvsched's restores and saves (no vLLM needed)."""

from __future__ import annotations

import pytest

from kvsched.integrations.vllm.mamba import GroupTables, MambaLayout

BS = 4


def _runner_copy(blocks: list[int], prev: int, start: int, end: int) -> tuple[int, int] | None:
    """vLLM's align-mode rule (mamba_utils.preprocess_mamba): (src, dst) block or None."""
    curr = -(-end // BS) - 1
    return (blocks[prev], blocks[curr]) if prev != -1 and prev != curr else None


def test_vllm_mamba_layout_gives_each_group_its_own_block_per_state_slot():
    layout = MambaLayout(kv_blocks=10, num_slots=4, num_groups=2, block_size=BS)
    assert layout.phys[1:].tolist() == [[11, 14], [12, 15], [13, 16]]
    assert layout.num_ids == 17
    layout.check()


def test_vllm_a_fresh_chunk_runs_in_the_runtime_block_and_the_runner_copies_nothing():
    layout = MambaLayout(10, 4, 1, BS)
    (row,) = layout.entries(start=0, end=6, sent=0, runtime=1, restore_from=0)
    assert row == [0, 11]
    assert _runner_copy(row, (0 - 1) // BS, 0, 6) is None


def test_vllm_a_restore_is_the_runners_copy_from_the_checkpoint_block():
    layout = MambaLayout(10, 4, 1, BS)
    (row,) = layout.entries(start=8, end=10, sent=0, runtime=1, restore_from=3)
    assert row == [0, 13, 11]
    assert _runner_copy(row, (8 - 1) // BS, 8, 10) == (13, 11)


def test_vllm_a_save_swaps_blocks_and_the_next_step_copies_the_state_forward():
    layout = MambaLayout(10, 4, 1, BS)
    (sent,) = layout.entries(start=0, end=8, sent=0, runtime=1, restore_from=0)
    assert sent == [0, 11]
    layout.saved(runtime=1, ckpt=3)  # the state after 8 tokens now belongs to slot 3
    assert layout.phys[3, 0] == 11 and layout.phys[1, 0] == 13
    (more,) = layout.entries(start=8, end=9, sent=2, runtime=1, restore_from=0)
    blocks = sent + more
    assert blocks == [0, 11, 13]
    assert _runner_copy(blocks, 1, 8, 9) == (11, 13)  # checkpoint block intact, state moved on
    (none,) = layout.entries(start=9, end=10, sent=3, runtime=1, restore_from=0)
    assert none == []  # decoding inside the running block: nothing new to send


def test_vllm_a_restore_that_is_not_block_aligned_cannot_be_expressed():
    with pytest.raises(ValueError, match="cannot be expressed"):
        MambaLayout(10, 4, 1, BS).entries(start=6, end=9, sent=0, runtime=1, restore_from=3)


def test_vllm_an_attention_only_model_sends_its_block_table_as_the_one_group():
    tables = GroupTables(attn_group=0, mamba_groups=[], num_groups=1, layout=None)
    assert tables.ids([5, 6], 0, 8, 0, 1, {}) == ([5, 6],)


def test_vllm_a_hybrid_model_sends_the_table_to_the_attention_group_and_states_to_the_others():
    layout = MambaLayout(10, 4, 2, BS)
    tables = GroupTables(attn_group=1, mamba_groups=[0, 2], num_groups=3, layout=layout)
    ids = tables.ids([5, 6], 8, 10, 0, 1, {1: 3})
    assert ids == ([0, 13, 11], [5, 6], [0, 16, 14])
