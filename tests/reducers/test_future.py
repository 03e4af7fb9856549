"""FutureUses: the recorded future folded from arrivals, and each checkpoint's next user."""

from __future__ import annotations

import numpy as np

from kvsched.events import types as ev
from kvsched.reducers.future import NEVER, FutureUses, reuse_error


def fold(owner: FutureUses, event: ev.Event) -> None:
    owner.folds()[type(event)](event)


def arrive(owner: FutureUses, seq_id: int, reuse: tuple[tuple[int, int], ...] = ()) -> None:
    fold(owner, ev.RequestArrived(seq_id, np.arange(1, 100, dtype=np.int32), 1, reuse=reuse))


def reserve(owner: FutureUses, ckpt_id: int, seq_id: int, step: int) -> None:
    fold(owner, ev.CheckpointReserved(ckpt_id, seq_id, 9, step, b"k" * 16, b"a" * 16, 0))


def test_a_checkpoint_is_next_used_by_its_producers_hint_then_by_each_restorers() -> None:
    owner = FutureUses()
    arrive(owner, 0, ((16, 2), (32, 1)))
    reserve(owner, 5, 0, 32)
    reserve(owner, 6, 0, 48)  # no hint there: no one will use it
    assert (owner.next_use(5), owner.next_use(6)) == (1, NEVER)
    arrive(owner, 1, ((32, 4),))
    fold(owner, ev.SequenceAdmitted(1, 1))
    fold(owner, ev.CheckpointPinned(5, 1))
    assert owner.next_use(5) == 4  # the restorer knows who comes after it


def test_a_next_user_admitted_without_the_checkpoint_will_not_use_it() -> None:
    owner = FutureUses()
    arrive(owner, 0, ((16, 1),))
    reserve(owner, 5, 0, 16)
    arrive(owner, 1)
    assert owner.next_use(5) == 1  # arrived, still waiting
    fold(owner, ev.SequenceAdmitted(1, 1))  # admitted with another hit
    assert owner.next_use(5) == NEVER


def test_ends_forget_hints_and_drops_forget_checkpoints() -> None:
    owner = FutureUses()
    arrive(owner, 0, ((16, 3),))
    reserve(owner, 5, 0, 16)
    fold(owner, ev.SequenceFinished(np.asarray([0]), ("stop",)))
    assert owner.hinted(0, 16) == NEVER and owner.next_use(5) == 3
    fold(owner, ev.CheckpointEvicted(5, -3.0))
    assert owner.snapshot() == ((), (), 0, (), ())


def test_reuse_pairs_must_ascend_in_whole_blocks_inside_the_request_and_name_later_ones() -> None:
    assert reuse_error(((16, 1), (32, 2)), 0, 40, 16) == ""
    assert "must ascend" in reuse_error(((32, 1), (16, 2)), 0, 40, 16)
    assert "later request" in reuse_error(((16, 0),), 0, 40, 16)
    assert reuse_error(((48, 1),), 0, 48, 16) == ""  # the prompt's end is a depth too
