"""With ``dedup_cached_blocks`` off (executors that cannot rewrite a block-table entry), a
computed block whose hash is already cached stays the sequence's private copy."""

from __future__ import annotations

import numpy as np
import pytest
from tests.policy.helpers import Harness, of_type, request, tokens

from kvsched.events import types as ev
from kvsched.stream.view import CacheView


def _twins(h: Harness) -> list:
    prompt = tokens(70, seed=5)  # four full 16-token blocks and a tail
    first = h.step([request(1, prompt), request(2, prompt.copy())])
    return [first, *h.run_until_idle()]


def _cached(results: list) -> list[ev.BlocksCached]:
    return [d for r in results for d in of_type(r.decisions, ev.BlocksCached)]


def test_twins_prefilled_in_one_step_keep_their_own_blocks_without_dedup():
    h = Harness(dedup_cached_blocks=False, max_prefill_tokens=256)
    tables: dict[int, list[int]] = {}
    h.step([request(1, tokens(70, seed=5)), request(2, tokens(70, seed=5))])
    plan = h.results[-1].plan
    for i, sid in enumerate(plan.seq_ids.tolist()):
        tables[sid] = plan.block_tables[i, : plan.num_blocks[i]].tolist()
    h.step()  # folds the outcome: the filled blocks are cached
    cached = _cached(h.results)
    assert len(cached) == 1
    marks = cached[0].replaced.tolist()
    assert marks.count(ev.PRIVATE_COPY) == 4 and marks.count(0) == 4
    t = h.state.seqs
    for sid, table in tables.items():  # no entry the executor was given has changed
        row = t.seq(sid).row
        assert t.table[row, : len(table)].tolist() == table
    assert h.state.pool.num_cached == 4
    h.run_until_idle()
    assert h.state.pool.num_cached == 4  # the private copies were freed, not cached
    assert len(h.state.pool.free) + h.state.pool.num_evictable == h.config.num_blocks - 1


@pytest.mark.parametrize("dedup", [True, False])
def test_a_later_request_hits_the_canonical_blocks_either_way(dedup: bool):
    h = Harness(dedup_cached_blocks=dedup, max_prefill_tokens=256)
    _twins(h)
    third = h.step([request(3, tokens(70, seed=5))])
    (match,) = of_type(third.decisions, ev.PrefixMatched)
    assert match.num_tokens == 64
    assert np.array_equal(match.blocks, h.state.pool.cached_prefix(h.state.seqs.seq(3).hashes, 4))


def test_a_cache_view_rebuilt_from_the_events_ignores_private_copies():
    h = Harness(dedup_cached_blocks=False, max_prefill_tokens=256)
    view = CacheView()
    for result in _twins(h):
        for event in (*result.inputs, *result.decisions):
            view.apply(event)
    assert view.prefix == h.state.pool.index


def test_with_dedup_on_the_twin_is_swapped_onto_the_cached_copy():
    h = Harness(max_prefill_tokens=256)
    _twins(h)
    marks = _cached(h.results)[0].replaced
    assert (marks > 0).sum() == 4 and not (marks == ev.PRIVATE_COPY).any()


def test_aligned_checkpoints_only_saves_states_at_block_boundaries_and_splits_the_tail():
    h = Harness(hybrid=True, aligned_checkpoints_only=True, max_prefill_tokens=256)
    first = h.step([request(1, tokens(70, seed=5))])  # 4 full 16-token blocks and 6 tokens
    (prefill,) = of_type(first.decisions, ev.PrefillScheduled)
    assert (prefill.starts.tolist(), prefill.ends.tolist()) == ([0], [64])  # the tail split
    results = [first, *h.run_until_idle()]
    steps = [d.num_tokens for r in results for d in of_type(r.decisions, ev.CheckpointReserved)]
    assert steps == [64]  # no partial-block checkpoint at the prompt end (70)
    hit = h.step([request(2, tokens(70, seed=5))])
    (match,) = of_type(hit.decisions, ev.PrefixMatched)
    assert match.num_tokens == 64 and match.ckpt_id >= 0
    assert not len(hit.plan.copy_blocks) and not len(hit.plan.copy_blocks_after)
