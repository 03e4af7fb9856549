"""LoadHoldings through its folds: the blocks a load without a batch row holds until it is
settled into a row or leaves."""

from __future__ import annotations

import numpy as np
import pytest
from tests.policy.test_external_loads import Store, request

from kvsched.events import types as ev
from kvsched.reducers.errors import ReplayMismatch


def _rowless_load(n_blocks: int = 6) -> Store:
    h = Store()
    h.run(request(0, 100))  # 7 blocks; the store has the chain blocks [0, 6)
    h.answer({0: n_blocks})
    assert h.state.seqs.seqs[0].row == -1
    return h


def test_a_load_admitted_without_a_row_holds_the_blocks_it_loads_into() -> None:
    h = _rowless_load()
    holdings = h.state.holdings
    assert holdings.is_rowless(0) and len(holdings.blocks_of(0)) == 6
    assert holdings.holders()[0].tolist() == holdings.blocks_of(0).tolist()
    assert (h.state.pool.ref[holdings.blocks_of(0)] == 1).all()


def test_a_load_settled_into_a_row_hands_its_blocks_to_the_row() -> None:
    h = _rowless_load()
    held = h.state.holdings.blocks_of(0).copy()
    h.finish_loads()
    seq = h.state.seqs.seqs[0]
    assert seq.row >= 0 and not h.state.holdings.is_rowless(0)
    assert h.state.seqs.blocks_of(seq.row)[: len(held)].tolist() == held.tolist()
    assert h.state.holdings.holders() == []


def test_a_load_that_leaves_still_holding_blocks_is_refused_naming_the_release() -> None:
    h = _rowless_load()
    h.state.apply(ev.KVLoadFinished(0))
    with pytest.raises(ReplayMismatch, match="BlocksFreed must release"):
        h.state.apply(ev.SequencePreempted(0, "test"))


def test_a_load_drops_only_the_tail_of_what_it_holds() -> None:
    h = _rowless_load()
    blocks = h.state.holdings.blocks_of(0)
    head = blocks[:1].copy()
    freed = ev.BlocksFreed(np.array([0]), np.array([1], dtype=np.int32), head)
    with pytest.raises(ReplayMismatch, match="does not hold"):
        h.state.apply(freed)


def test_a_load_cannot_hold_more_blocks_than_a_block_table() -> None:
    h = _rowless_load()
    holdings = h.state.holdings
    width = holdings.max_blocks
    extra = np.arange(1, width + 1, dtype=np.int32)
    grow = ev.BlocksAllocated(np.array([0]), np.array([width], dtype=np.int32), extra)
    with pytest.raises(ReplayMismatch, match="cannot take"):
        holdings.folds()[ev.BlocksAllocated](grow)


def test_the_holdings_check_finds_a_holding_of_no_rowless_load() -> None:
    h = _rowless_load()
    assert h.state.holdings.check_invariants({0}) is None
    assert "loads without a row []" in (h.state.holdings.check_invariants(set()) or "")


def test_a_rowless_loads_blocks_are_handed_out_read_only() -> None:
    store = _rowless_load()
    seq = store.state.seq(0)
    for blocks in (store.state.holdings.blocks_of(0), store.state.seqs.block_table(seq)):
        assert len(blocks) and not blocks.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            blocks[0] = 0
