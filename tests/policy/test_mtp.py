"""MTP recompute overlap: the last cached block of a hit is recomputed (whatever the number of
speculative tokens, as lmdeploy) into a private block the sequence keeps, while it holds the
cached block, which stays shared and cached and from which its later blocks chain. Logs before
schema 4 recomputed the last k blocks and swapped them for the cached copies."""

import numpy as np
import pytest
from tests.policy.helpers import Harness, matched, of_type, preset, request, tokens

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.events.codec import SCHEMA_VERSION


def _blocks_allocated_to(results, seq_id: int) -> list[int]:
    out: list[int] = []
    for r in results:
        for d in of_type(r.decisions, ev.BlocksAllocated):
            bounds = np.concatenate(([0], np.cumsum(d.counts)))
            for i, s in enumerate(d.seq_ids.tolist()):
                if s == seq_id:
                    out.extend(d.blocks[bounds[i] : bounds[i + 1]].tolist())
    return out


def _serve_producer(h: Harness, prompt: np.ndarray) -> list[int]:
    """Serve request 0 (``prompt``, one output token); return the blocks it was given."""
    h.step([request(0, prompt, max_tokens=1)])
    h.run_until_idle()
    return _blocks_allocated_to(h.results, 0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_an_mtp_hit_recomputes_exactly_its_last_cached_block_whatever_the_speculative_tokens(
    k: int,
) -> None:
    h = Harness(num_speculative_tokens=k)
    prompt = tokens(64, seed=7)
    producer = _serve_producer(h, prompt)
    admit = h.step([request(1, np.concatenate([prompt, tokens(10, seed=8)]), max_tokens=3)])
    hit = matched(admit)[1]
    assert hit.num_tokens == 48  # 4 cached blocks, the last one recomputed
    assert hit.blocks.tolist() == producer[:3]
    assert hit.overlap_block == producer[3]  # held by the sequence, not in its table
    private = _blocks_allocated_to([admit], 1)[0]
    assert private not in producer
    assert h.state.seqs.table[h.state.seq(1).row, 3] == private


def test_an_mtp_sequence_keeps_its_private_copy_and_the_cached_block_stays_shared() -> None:
    h = Harness(num_speculative_tokens=2)
    prompt = tokens(64, seed=7)
    producer = _serve_producer(h, prompt)
    consumer = np.concatenate([prompt, tokens(30, seed=8)])
    h.step([request(1, consumer, max_tokens=3)])
    private = _blocks_allocated_to(h.results[-1:], 1)[0]
    h.step()  # the outcome caches the computed blocks
    seq, pool = h.state.seq(1), h.state.pool
    row = seq.row
    assert h.state.seqs.table[row, 3] == private  # kept: the draft model's KV row is in it
    assert pool.hash_of[private] is None  # a private copy, never indexed
    assert pool.index[seq.hashes[3]] == producer[3] and pool.ref[producer[3]] == 1
    h.step()
    h.step()  # its second chunk computed and cached
    fifth = int(h.state.seqs.table[row, 4])  # its own next block, cached under the shared one
    assert pool.parent_of[fifth] == seq.hashes[3]
    h.run_until_idle()
    # A third request hits its chain through the cached block (and recomputes block 4).
    third = h.step([request(2, np.concatenate([consumer, tokens(20, seed=9)]), max_tokens=1)])
    hit = matched(third)[2]
    assert hit.blocks.tolist() == producer[:4] and hit.overlap_block == fifth
    h.run_until_idle()  # done: the private copy is freed, the cached block stays cached
    assert pool.ref.sum() == 0 and private in pool.free and pool.hash_of[producer[3]]


def test_the_cached_block_an_mtp_hit_recomputes_is_never_evicted_for_its_private_copy() -> None:
    h = Harness(num_speculative_tokens=1, num_blocks=7)  # 6 usable blocks
    prompt = tokens(64, seed=7)
    producer = _serve_producer(h, prompt)  # 4 cached blocks
    h.step([request(2, tokens(32, seed=3), max_tokens=1)])  # 2 more, released later
    h.run_until_idle()
    assert not h.state.pool.free  # every block is cached: an allocation evicts
    admit = h.step([request(1, np.concatenate([prompt, tokens(10, seed=8)]), max_tokens=2)])
    evicted = [b for d in of_type(admit.decisions, ev.BlocksEvicted) for b in d.blocks.tolist()]
    assert evicted and producer[3] not in evicted  # the other request's leaf goes instead
    h.run_until_idle()
    assert h.state.pool.hash_of[producer[3]] is not None  # never replaced by the private copy


def test_an_mtp_sessions_next_turn_holds_the_cached_chain_not_the_private_copy() -> None:
    h = Harness(num_speculative_tokens=1)
    prompt = tokens(64, seed=7)
    producer = _serve_producer(h, prompt)
    h.step([request(1, np.concatenate([prompt, tokens(10, seed=8)]), max_tokens=2, session_id=4)])
    private = _blocks_allocated_to(h.results[-1:], 1)[0]
    h.run_until_idle()
    held = h.state.sessions.get(4).held.tolist()
    assert held[:4] == producer[:4] and private not in held
    result = h.step([request(3, tokens(20, seed=11), max_tokens=1, session_id=4)])
    hit = matched(result)[3]
    assert hit.blocks.tolist() == producer[:3] and hit.overlap_block == producer[3]
    h.run_until_idle()
    h.state.check_invariants()


def test_without_speculative_tokens_the_whole_cached_prefix_is_reused() -> None:
    h = Harness()
    prompt = tokens(64, seed=7)
    h.step([request(0, prompt, max_tokens=1)])
    h.run_until_idle()
    admit = h.step([request(1, np.concatenate([prompt, tokens(10, seed=8)]), max_tokens=3)])
    assert matched(admit)[1].num_tokens == 64


@pytest.mark.parametrize("k", [1, 2])
def test_a_hybrid_mtp_hit_needs_one_cached_block_beyond_its_checkpoint_and_later_checkpoints_chain_from_the_cached_block(  # noqa: E501
    k: int,
) -> None:
    h = Harness(
        hybrid=True,
        checkpoint_budget=8,
        max_prefill_tokens=16,
        num_speculative_tokens=k,
        **preset("lmdeploy"),
    )
    prompt = tokens(64, seed=7)
    producer = _serve_producer(h, prompt)
    published = {c.step for c in h.state.ckpts.ckpts.values()}
    assert published == {16, 32, 48, 64}
    extended = np.concatenate([prompt, tokens(10, seed=8)])
    admit = h.step([request(1, extended, max_tokens=3)])
    hit = matched(admit)[1]
    # The checkpoint at 64 has no cached block after it: the one at 48 is restored and its
    # next block (cached) is the overlap, recomputed privately.
    assert hit.num_tokens == 48 and hit.ckpt_id >= 0
    assert hit.overlap_block == producer[3]
    private = _blocks_allocated_to([admit], 1)[0]
    assert h.state.seqs.table[h.state.seq(1).row, 3] == private
    h.run_until_idle()
    ends = {c.step: c for c in h.state.ckpts.ckpts.values()}
    assert 74 in ends  # the consumer's prompt-end checkpoint, on the cached chain
    assert ends[74].path.tolist() == producer[:4]
    assert private not in ends[74].path.tolist()


def test_old_logs_recompute_k_blocks_and_swap_them_for_the_cached_copies() -> None:
    legacy = SchedulerConfig.from_log_header({"num_speculative_tokens": 2}, schema_version=3)
    assert legacy.legacy.mtp_overlap == "k_blocks" and legacy.mtp_recompute_blocks == 2
    assert SchedulerConfig.from_log_header({}, schema_version=4).legacy.mtp_overlap == "one_block"
    h = Harness(num_speculative_tokens=2, mtp_overlap="k_blocks")
    prompt = tokens(64, seed=7)
    producer = _serve_producer(h, prompt)
    admit = h.step([request(1, np.concatenate([prompt, tokens(10, seed=8)]), max_tokens=3)])
    hit = matched(admit)[1]
    assert hit.num_tokens == 32 and not hit.overlap_block
    h.step()  # the outcome caches the recomputed blocks: swapped for the cached copies
    assert h.state.seqs.table[h.state.seq(1).row, :4].tolist() == producer[:4]


def test_an_unknown_mtp_overlap_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="mtp_overlap"):
        SchedulerConfig.from_log_header(dict(mtp_overlap="two_blocks"), SCHEMA_VERSION)
