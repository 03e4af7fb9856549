"""The checkpoint table's columns (``reducers/ckpt_columns.py``): each fold that changes a
record writes its row, a dropped checkpoint leaves, and the invariants compare them."""

from __future__ import annotations

import numpy as np
from tests.reducers.test_checkpoints import drop, make_table, pin, published, reserve, unpin

from kvsched.events import types as ev


def test_the_columns_follow_reserve_publish_pin_unpin_and_drop() -> None:
    table = make_table(max_batch=1, budget=3)
    c = reserve(table, 32, b"k1")
    cols = table.value_columns()
    assert cols.live[c.slot] and not cols.evictable[c.slot]  # reserved: live, not a candidate
    published(table, 16, b"k2")
    table.folds()[ev.StepStarted](ev.StepStarted(0, 0.0))
    assert table.check_invariants({}) is None
    d = table.find(b"k2")
    assert d is not None and cols.evictable[d.slot] and cols.stamp[d.slot] == d.stamp
    pin(table, d)
    assert not cols.evictable[d.slot] and cols.hits[d.slot] == 1
    unpin(table, d)
    assert cols.evictable[d.slot] and cols.stamp[d.slot] == d.stamp
    assert cols.kinds[cols.kind[d.slot]] == d.kind
    drop(table, d, ev.CheckpointEvicted)
    assert not cols.live[d.slot] and not cols.evictable[d.slot]
    assert table.check_invariants({}) is None


def test_a_column_that_disagrees_with_its_record_breaks_the_invariants() -> None:
    table = make_table(max_batch=1, budget=2)
    c = published(table, 16, b"k")
    table.columns.hits[c.slot] = 5  # (a fold that forgot to write its row)
    assert "checkpoint columns" in (table.check_invariants({}) or "")


def test_the_columns_given_to_readers_are_read_only() -> None:
    table = make_table(max_batch=1, budget=2)
    cols = table.value_columns()
    assert not any(a.flags.writeable for a in cols[:-1] if isinstance(a, np.ndarray))
