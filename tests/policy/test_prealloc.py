"""Decode preallocation (``decode_prealloc_tokens``): a decode that needs a new block takes
blocks for its next tokens too, from free blocks only, and gives the spares back before any
session hold, checkpoint or sequence is given up for room."""

from __future__ import annotations

from kvsched.events import types as ev

from .helpers import Harness, of_type, request


def growth(h: Harness) -> list[tuple[int, list[int], list[int]]]:
    """(step, sequences, blocks each) of every allocation after the first step's."""
    return [
        (r.step, d.seq_ids.tolist(), d.counts.tolist())
        for r in h.results[1:]
        for d in of_type(r.decisions, ev.BlocksAllocated)
    ]


def serve_two(prealloc: int) -> Harness:
    h = Harness(decode_prealloc_tokens=prealloc)
    h.step([request(0, 20, max_tokens=60), request(1, 40, max_tokens=30)])
    h.run_until_idle()
    return h


def test_a_decode_crossing_a_block_boundary_takes_the_next_tokens_blocks_in_fewer_allocations():
    one_at_a_time = serve_two(0)
    ahead = serve_two(16)  # one 16-token block ahead
    assert len(growth(one_at_a_time)) == 5 and all(c == [1] for _, _, c in growth(one_at_a_time))
    assert growth(ahead) == [(10, [1], [2]), (14, [0], [2]), (46, [0], [1])]
    # Never past the last position a sequence can write (prompt + max_tokens - 2).
    assert ahead.engine.state.stats.generated_tokens == 90
    assert growth(serve_two(40)) == [(10, [1], [2]), (14, [0], [3])]


def test_spare_blocks_go_back_before_a_decode_would_preempt_for_room() -> None:
    # 5 usable blocks: 0 holds 1, 1 holds 2. 0's first decode takes its block and a spare (the
    # last free one); when 1 needs a block, the spare goes back instead of a preemption.
    h = Harness(decode_prealloc_tokens=32, num_blocks=6)
    h.step([request(0, 16, max_tokens=30), request(1, 30, max_tokens=4)])
    h.run_until_idle()
    assert growth(h)[0] == (2, [0], [2])
    returned = of_type(h.results[3].decisions, ev.BlocksFreed)
    assert [(d.seq_ids.tolist(), d.counts.tolist()) for d in returned] == [([0], [1])]
    assert h.state.stats.preemptions == 0
    assert h.state.stats.requests_finished == 2


def test_preallocation_takes_only_free_blocks_and_never_evicts_a_cached_one() -> None:
    h = Harness(decode_prealloc_tokens=32, num_blocks=6)
    h.step([request(9, 48, max_tokens=1)])  # leaves 3 cached blocks, 2 free
    h.run_until_idle()
    h.step([request(0, 16, max_tokens=40)])  # takes 1 free block
    first_decode = h.step()
    (alloc,) = of_type(first_decode.decisions, ev.BlocksAllocated)
    assert alloc.counts.tolist() == [1]  # the last free block, no spare
    assert not of_type(first_decode.decisions, ev.BlocksEvicted)
    assert h.state.pool.num_evictions == 0


def test_an_admission_short_of_blocks_takes_the_spares_back_first() -> None:
    h = Harness(decode_prealloc_tokens=48, num_blocks=8)  # 7 usable blocks
    h.step([request(0, 16, max_tokens=60)])
    h.step()  # 0 decodes position 16: its block and 3 spares up to position 64 (5 of 7)
    assert h.state.seqs.nblocks[h.state.seq(0).row] == 5
    admission = h.step([request(1, 40, max_tokens=2)])  # needs 3 blocks, 2 are free
    (freed,) = of_type(admission.decisions, ev.BlocksFreed)
    assert freed.seq_ids.tolist() == [0] and freed.counts.tolist() == [3]
    assert [d.seq_id for d in of_type(admission.decisions, ev.SequenceAdmitted)] == [1]
    h.run_until_idle()
    assert h.state.stats.preemptions == 0
