"""events/closing.py: ``with obj:`` closes the object, also when the block raises."""

from __future__ import annotations

import pytest

from kvsched.events.closing import Closing


class Counted(Closing):
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_with_block_closes_its_object_once_on_exit_even_after_an_exception():
    with Counted() as a:
        pass
    assert a.closed == 1
    b = Counted()
    with pytest.raises(KeyError), b:
        raise KeyError("x")
    assert b.closed == 1
