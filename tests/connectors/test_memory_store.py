"""connectors/memory_store.py: ``InProcessStore``, an LRU store in this process's memory."""

from __future__ import annotations

import pytest

from kvsched.connectors.errors import InvalidRequest, StoreUnavailable, TransferFailed
from kvsched.connectors.memory_store import Faults, InProcessStore


def test_the_first_writer_of_a_key_wins():
    store = InProcessStore()
    store.put_many([("k", b"first")])
    store.put_many([("k", b"second")])
    assert store.get_many(["k", "absent"]) == [b"first", None]
    assert store.batch_exists(["k", "absent"]) == [True, False]


def test_values_past_the_capacity_evict_the_least_recently_used():
    store = InProcessStore(capacity_bytes=8)
    store.put_many([("a", b"1234"), ("b", b"5678")])
    store.get_many(["a"])  # b is now the least recently used
    store.put_many([("c", b"9abc")])
    assert store.batch_exists(["a", "b", "c"]) == [True, False, True]
    assert store.evictions == 1 and store.used_bytes == 8


def test_an_empty_value_or_one_larger_than_the_store_is_refused_whole():
    store = InProcessStore(capacity_bytes=4)
    for items in ([("a", b"12"), ("b", b"")], [("a", b"12"), ("b", b"12345")]):
        with pytest.raises(InvalidRequest):
            store.put_many(items)
    assert len(store) == 0


def test_an_injected_read_failure_carries_the_good_leading_values():
    store = InProcessStore(faults=Faults(fail_keys={"c"}))
    store.put_many([("a", b"1"), ("b", b"2"), ("c", b"3")])
    with pytest.raises(TransferFailed) as failed:
        store.get_many(["a", "b", "c"])
    assert list(failed.value.partial) == [b"1", b"2"]


def test_a_closed_store_is_unavailable():
    store = InProcessStore()
    store.close()
    with pytest.raises(StoreUnavailable):
        store.batch_exists(["a"])
