"""MTP recompute overlap: the last k cached blocks of a hit are recomputed into private blocks,
and once computed they are swapped for the canonical shared blocks."""

import numpy as np
from tests.policy.helpers import Harness, matched, of_type, request, tokens

from kvsched.config import CHECKPOINT_POLICIES
from kvsched.events import types as ev


def _blocks_allocated_to(results, seq_id: int) -> list[int]:
    out: list[int] = []
    for r in results:
        for d in of_type(r.decisions, ev.BlocksAllocated):
            bounds = np.concatenate(([0], np.cumsum(d.counts)))
            for i, s in enumerate(d.seq_ids.tolist()):
                if s == seq_id:
                    out.extend(d.blocks[bounds[i] : bounds[i + 1]].tolist())
    return out


def test_with_one_speculative_token_the_last_cached_block_of_a_hit_is_recomputed() -> None:
    h = Harness(num_speculative_tokens=1)
    prompt = tokens(64, seed=7)
    h.step([request(0, prompt, max_tokens=1)])
    h.run_until_idle()
    producer_blocks = _blocks_allocated_to(h.results, 0)
    admit = h.step([request(1, np.concatenate([prompt, tokens(10, seed=8)]), max_tokens=3)])
    hit = matched(admit)[1]
    assert hit.num_tokens == 48  # 4 cached blocks, the last recomputed
    assert hit.blocks.tolist() == producer_blocks[:3]
    private = _blocks_allocated_to([admit], 1)[0]
    assert private not in producer_blocks
    assert h.state.seqs.table[h.state.seq(1).row, 3] == private
    h.step()  # the outcome registers block 3: it is swapped for the canonical copy
    row = h.state.seq(1).row
    assert h.state.seqs.table[row, :4].tolist() == producer_blocks[:4]


def test_without_speculative_tokens_the_whole_cached_prefix_is_reused() -> None:
    h = Harness()
    prompt = tokens(64, seed=7)
    h.step([request(0, prompt, max_tokens=1)])
    h.run_until_idle()
    admit = h.step([request(1, np.concatenate([prompt, tokens(10, seed=8)]), max_tokens=3)])
    assert matched(admit)[1].num_tokens == 64


def test_a_hybrid_mtp_hit_needs_cached_kv_beyond_its_checkpoint_and_later_checkpoints_use_canonical_blocks() -> None:  # noqa: E501
    h = Harness(
        hybrid=True, checkpoint_budget=8, max_prefill_tokens=32, num_speculative_tokens=1,
        **CHECKPOINT_POLICIES["lmdeploy"],
    )
    prompt = tokens(64, seed=7)
    h.step([request(0, prompt, max_tokens=1)])
    h.run_until_idle()
    producer_blocks = _blocks_allocated_to(h.results, 0)
    published = {c.step for c in h.state.ckpts.ckpts.values()}
    assert published == {32, 64}
    extended = np.concatenate([prompt, tokens(10, seed=8)])
    admit = h.step([request(1, extended, max_tokens=3)])
    hit = matched(admit)[1]
    # The checkpoint at 64 has no cached block after it: the one at 32 is restored and the
    # two cached blocks after it are recomputed.
    assert hit.num_tokens == 32 and hit.ckpt_id >= 0
    h.run_until_idle()
    ends = {c.step: c for c in h.state.ckpts.ckpts.values()}
    assert 74 in ends  # the consumer's prompt-end checkpoint
    assert ends[74].path.tolist() == producer_blocks[:4]


def test_without_mtp_a_hybrid_hit_restores_the_deepest_checkpoint() -> None:
    h = Harness(hybrid=True, checkpoint_budget=8, max_prefill_tokens=32)
    prompt = tokens(64, seed=7)
    h.step([request(0, prompt, max_tokens=1)])
    h.run_until_idle()
    admit = h.step([request(1, np.concatenate([prompt, tokens(10, seed=8)]), max_tokens=3)])
    assert matched(admit)[1].num_tokens == 64
