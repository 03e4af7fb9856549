"""SaveQueue: checkpoints reserved but not yet published, kept by the step that saves them."""

from __future__ import annotations

from kvsched.reducers.ckpt_saves import SaveQueue


def test_a_step_start_launches_the_step_before_with_its_reservations():
    q = SaveQueue()
    q.start(4)
    q.reserve(1, b"a")
    assert q.awaiting_ids() == [] and q.reserved_keys == {b"a": 1}
    q.start(5)
    assert q.awaiting_ids(4) == [1] and q.launched(1) and q.reserved_keys == {}


def test_a_step_that_reserves_nothing_leaves_the_launched_ones_waiting():
    q = SaveQueue()
    q.start(1)
    q.reserve(1, b"a")
    q.start(2)
    q.start(3)  # (step 2 reserved nothing: step 1's save still waits for step 1's outcome)
    assert q.awaiting_ids(1) == [1] and q.awaiting_ids(2) == []


def test_removing_a_published_save_empties_its_step():
    q = SaveQueue()
    q.start(1)
    q.reserve(1, b"a")
    q.reserve(2, b"b")
    q.start(2)
    q.remove(1, b"a")
    assert q.awaiting_ids(1) == [2]
    q.remove(2, b"b")
    assert q.awaiting == {} and not q.launched(2)


def test_the_queues_must_hold_exactly_the_reserved_checkpoints():
    q = SaveQueue()
    q.start(1)
    q.reserve(1, b"a")
    q.start(2)
    q.reserve(2, b"b")
    assert q.problem({1: b"a", 2: b"b"}) is None
    assert "reserved by no step" in (q.problem({1: b"a", 2: b"b", 3: b"c"}) or "")
    assert "not reserved" in (q.problem({2: b"b"}) or "")
    q.reserved_keys[b"x"] = 2
    assert "identity index" in (q.problem({1: b"a", 2: b"b"}) or "")
