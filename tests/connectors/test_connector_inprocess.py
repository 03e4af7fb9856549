"""The connector over the default in-process store, including injected faults."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvsched.connectors import (
    PENDING,
    Faults,
    HostBlockBuffer,
    HostStateBuffer,
    InProcessStore,
    InvalidRequest,
    KVStore,
    LoadOrder,
    LookupRequest,
    LookupResult,
    SaveOrder,
    StoreConnector,
    StoreUnavailable,
    TransferEngine,
    TransferReport,
    block_key,
    report_events,
    state_key,
)
from kvsched.connectors.buffers import encode_state
from kvsched.events.types import (
    KVLoadFailed,
    KVLoadFinished,
    KVLoadStarted,
    KVLookupStarted,
    KVSaveFinished,
    KVSaveStarted,
)

from .helpers import BLOCK_BYTES, chain, filled_buffer, save_chain


def _load(
    store: KVStore, root: bytes, hashes: list[bytes], n: int, *, timeout_s: float = 10.0
) -> tuple[HostBlockBuffer, TransferReport, float]:
    dst = HostBlockBuffer(n + 4, BLOCK_BYTES)
    engine = TransferEngine(store, dst, batch_blocks=4, job_timeout_s=timeout_s)
    t0 = time.monotonic()
    engine.start_load(7, [block_key(root, h) for h in hashes[:n]], list(range(4, 4 + n)))
    report = engine.poll()
    while report.is_empty:
        assert time.monotonic() - t0 < timeout_s + 5, "load neither finished nor failed"
        time.sleep(0.005)
        report = engine.poll()
    engine.close()
    return dst, report, time.monotonic() - t0


def test_blocks_round_trip_byte_identical_through_the_in_process_store() -> None:
    store = InProcessStore()
    root, hashes = chain(10)
    src = filled_buffer(12)
    save_chain(store, root, hashes, src, [2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    dst, report, _ = _load(store, root, hashes, 10)
    assert report.finished_loads == {7} and not report.failed_loads
    assert np.array_equal(dst.data[4:14], src.data[2:12])


def test_state_checkpoint_round_trips_with_its_blocks() -> None:
    store = InProcessStore()
    root, hashes = chain(3)
    src, src_states = filled_buffer(3), HostStateBuffer(2, 64, 256)
    src_states.conv[1] = 7
    src_states.recurrent[1] = np.arange(256, dtype=np.uint8)
    engine = TransferEngine(store, src, src_states)
    keys = [block_key(root, h) for h in hashes]
    engine.start_save(1, keys, [0, 1, 2], state=(state_key(root, hashes[-1]), 1))
    assert engine.wait_idle() and engine.poll().finished_saves == {1}

    dst, dst_states = HostBlockBuffer(3, BLOCK_BYTES), HostStateBuffer(4, 64, 256)
    loader = TransferEngine(store, dst, dst_states)
    loader.start_load(5, keys, [2, 1, 0], state=(state_key(root, hashes[-1]), 3))
    assert loader.wait_idle() and loader.poll().finished_loads == {5}
    assert np.array_equal(dst.data[::-1], src.data)
    assert dst_states.read_state(3) == src_states.read_state(1)


def test_a_load_whose_state_checkpoint_is_missing_fails_with_no_usable_block() -> None:
    store = InProcessStore()
    root, hashes = chain(2)
    save_chain(store, root, hashes, filled_buffer(2), [0, 1])
    loader = TransferEngine(store, HostBlockBuffer(2, BLOCK_BYTES), HostStateBuffer(1, 8, 8))
    keys = [block_key(root, h) for h in hashes]
    loader.start_load(1, keys, [0, 1], state=(state_key(root, hashes[-1]), 0))
    assert loader.wait_idle()
    good, reason = loader.poll().failed_loads[1]
    assert good == 0 and "state checkpoint" in reason


def test_in_process_store_evicts_least_recently_used_and_keeps_the_first_writer() -> None:
    store = InProcessStore(capacity_bytes=3 * 10)
    store.put_many([("a", b"a" * 10), ("b", b"b" * 10), ("c", b"c" * 10)])
    store.put_many([("a", b"X" * 10)])  # present: kept, touched
    assert store.get_many(["a"]) == [b"a" * 10]
    store.put_many([("d", b"d" * 10)])  # evicts b, the least recently used
    assert store.batch_exists(["a", "b", "c", "d"]) == [True, False, True, True]
    assert store.used_bytes == 30 and store.evictions == 1
    store.remove(["a", "zz"])
    assert store.get_many(["a", "c"]) == [None, b"c" * 10]
    with pytest.raises(InvalidRequest):
        store.put_many([("e", b"")])
    store.close()
    with pytest.raises(StoreUnavailable):
        store.get_many(["c"])


def test_lookup_counts_only_the_leading_present_blocks() -> None:
    store = InProcessStore()
    root, hashes = chain(8)
    store.put_many([(block_key(root, hashes[i]), b"x") for i in (0, 1, 2, 4, 5)])
    conn = StoreConnector(store, synchronous=True)
    req = LookupRequest(seq_id=1, namespace_root=root, block_hashes=tuple(hashes))
    assert conn.lookup(req) == LookupResult(3)
    # blocks the scheduler already has locally count as present: ask from block 4 on
    conn.cancel_lookup(1)
    req2 = LookupRequest(
        seq_id=1, namespace_root=root, block_hashes=tuple(hashes[4:]), first_block=4
    )
    assert conn.lookup(req2) == LookupResult(6)


def test_lookup_with_state_ends_at_the_last_block_that_has_a_checkpoint() -> None:
    store = InProcessStore()
    root, hashes = chain(6)
    store.put_many([(block_key(root, h), b"x") for h in hashes[:5]])
    store.put_many([(state_key(root, hashes[i]), encode_state(b"c", b"r")) for i in (1, 5)])
    conn = StoreConnector(store, synchronous=True)
    req = LookupRequest(seq_id=1, namespace_root=root, block_hashes=tuple(hashes), with_state=True)
    assert conn.lookup(req).num_blocks == 2  # blocks 0..4 present, checkpoints after 1 and 5


def test_lookup_under_another_namespace_finds_nothing() -> None:
    store = InProcessStore()
    root, hashes = chain(4)
    save_chain(store, root, hashes, filled_buffer(4), [0, 1, 2, 3])
    other_root, other_hashes = chain(4, salt="another tenant")  # same tokens, other salt
    conn = StoreConnector(store, synchronous=True)
    req = LookupRequest(seq_id=1, namespace_root=other_root, block_hashes=tuple(other_hashes))
    assert conn.lookup(req) == LookupResult(0)


def test_asynchronous_lookup_answers_pending_until_the_probe_is_back() -> None:
    store = InProcessStore(faults=Faults())
    root, hashes = chain(4)
    store.put_many([(block_key(root, h), b"x") for h in hashes])
    conn = StoreConnector(store)
    gate = __import__("threading").Event()
    real = store.batch_exists
    store.batch_exists = lambda keys: (gate.wait(5), real(keys))[1]  # type: ignore[method-assign]
    req = LookupRequest(seq_id=3, namespace_root=root, block_hashes=tuple(hashes))
    assert conn.lookup(req) is PENDING
    assert conn.lookup(req) is PENDING
    gate.set()
    deadline = time.monotonic() + 5
    while (answer := conn.lookup(req)) is PENDING:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert answer == LookupResult(4)
    assert conn.lookup(req) == answer  # repeatable until cancelled
    conn.close()


def test_lookup_against_an_unavailable_store_answers_no_external_blocks_with_a_reason() -> None:
    store = InProcessStore(faults=Faults(unavailable=True))
    root, hashes = chain(4)
    conn = StoreConnector(store, synchronous=True)
    req = LookupRequest(
        seq_id=1, namespace_root=root, block_hashes=tuple(hashes[1:]), first_block=1
    )
    result = conn.lookup(req)
    assert isinstance(result, LookupResult)
    assert result.num_blocks == 1 and "unavailable" in result.reason


def test_a_lookup_that_outlives_its_timeout_answers_no_external_blocks() -> None:
    store = InProcessStore()
    root, hashes = chain(2)
    store.batch_exists = lambda keys: (time.sleep(1.0), [True] * len(keys))[1]  # type: ignore[method-assign]
    conn = StoreConnector(store, lookup_timeout_s=0.05)
    req = LookupRequest(seq_id=1, namespace_root=root, block_hashes=tuple(hashes))
    assert conn.lookup(req) is PENDING
    time.sleep(0.1)
    result = conn.lookup(req)
    assert isinstance(result, LookupResult) and result.num_blocks == 0
    assert "timed out" in result.reason
    conn.close()


def test_a_load_with_a_missing_key_fails_keeping_the_blocks_before_it() -> None:
    store = InProcessStore()
    root, hashes = chain(10)
    src = filled_buffer(10)
    save_chain(store, root, hashes, src, list(range(10)))
    store.remove([block_key(root, hashes[6])])
    dst, report, _ = _load(store, root, hashes, 10)
    good, reason = report.failed_loads[7]
    assert good == 6 and "missing" in reason
    assert np.array_equal(dst.data[4:10], src.data[0:6])
    assert not dst.data[10:].any()


def test_one_failing_block_of_several_fails_the_load_at_that_block() -> None:
    store = InProcessStore()
    root, hashes = chain(10)
    src = filled_buffer(10)
    save_chain(store, root, hashes, src, list(range(10)))
    store.faults.fail_keys.add(block_key(root, hashes[5]))
    dst, report, _ = _load(store, root, hashes, 10)
    good, reason = report.failed_loads[7]
    assert good == 5 and "TransferFailed" in reason
    assert np.array_equal(dst.data[4:9], src.data[0:5])
    assert not dst.data[9:].any()


def test_a_store_that_fails_after_n_gets_fails_the_load_with_n_good_blocks() -> None:
    store = InProcessStore()
    root, hashes = chain(10)
    save_chain(store, root, hashes, filled_buffer(10), list(range(10)))
    store.faults.fail_after_gets = 7
    _, report, _ = _load(store, root, hashes, 10)
    assert report.failed_loads[7][0] == 7


def test_a_store_that_stops_answering_fails_the_load_in_bounded_time() -> None:
    store = InProcessStore()
    root, hashes = chain(4)
    src = filled_buffer(4)
    save_chain(store, root, hashes, src, [0, 1, 2, 3])
    store.faults.get_delay_s = 1.5
    dst, report, elapsed = _load(store, root, hashes, 4, timeout_s=0.2)
    good, reason = report.failed_loads[7]
    assert good == 0 and "timed out" in reason
    assert elapsed < 1.0
    time.sleep(1.6)  # the stuck read returns now: it must not write into reused blocks
    assert not dst.data.any()


def test_a_block_of_the_wrong_size_fails_the_load_as_corrupt() -> None:
    store = InProcessStore()
    root, hashes = chain(2)
    store.put_many([(block_key(root, hashes[0]), b"\x01" * BLOCK_BYTES)])
    store.put_many([(block_key(root, hashes[1]), b"\x01" * 10)])
    _, report, _ = _load(store, root, hashes, 2)
    good, reason = report.failed_loads[7]
    assert good == 1 and "corrupt" in reason


def test_orders_are_built_from_the_decisions_alone() -> None:
    root, hashes = chain(6)
    blob = b"".join(hashes[2:5])
    lookup = KVLookupStarted(4, 2, 5, root, blob, with_state=True)
    req = LookupRequest.from_event(lookup)
    assert (req.seq_id, req.first_block, req.with_state) == (4, 2, True)
    assert req.block_hashes == tuple(hashes[2:5])
    blocks = np.array([30, 31, 32], dtype=np.int32)
    load = LoadOrder.from_event(KVLoadStarted(4, blocks, 2, root, blob, 9, hashes[4]))
    assert load.keys == tuple(block_key(root, h) for h in hashes[2:5])
    assert load.block_ids == (30, 31, 32)
    assert (load.state_key, load.state_slot) == (state_key(root, hashes[4]), 9)
    plain = LoadOrder.from_event(KVLoadStarted(4, blocks, 2, root, blob))
    assert plain.state_key is None and plain.state_slot == -1
    save = SaveOrder.from_event(KVSaveStarted(7, 4, blocks, 2, root, blob, ckpt_id=3, state_slot=5))
    assert (save.save_id, save.seq_id, save.block_ids) == (7, 4, (30, 31, 32))
    assert save.keys == load.keys and save.state_key == state_key(root, hashes[4])
    assert SaveOrder.from_event(KVSaveStarted(8, 4, blocks, 2, root, blob)).state_key is None


def test_a_lookup_from_a_started_lookup_counts_from_its_first_block() -> None:
    store = InProcessStore()
    root, hashes = chain(6)
    store.put_many([(block_key(root, h), b"x") for h in hashes[:5]])
    conn = StoreConnector(store, synchronous=True)
    lookup = KVLookupStarted(4, 2, 6, root, b"".join(hashes[2:6]))
    assert conn.lookup(LookupRequest.from_event(lookup)) == LookupResult(5)


def test_report_events_are_the_scheduler_input_events_in_sorted_order() -> None:
    report = TransferReport(
        finished_loads=frozenset({3, 1}),
        failed_loads={2: (5, "gone")},
        finished_saves=frozenset({9}),
        failed_saves={8: "x"},
    )
    assert report_events(report) == [
        KVLoadFinished(seq_id=1),
        KVLoadFinished(seq_id=3),
        KVLoadFailed(seq_id=2, num_good_blocks=5, reason="gone"),
        KVSaveFinished(save_id=9, ok=True),
        KVSaveFinished(save_id=8, ok=False),
    ]
