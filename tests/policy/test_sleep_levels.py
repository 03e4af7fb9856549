"""Sleep levels: a drain is asked for at a level (1: the executor releases its KV cache; 2:
its weights too) and ``Drained`` carries it to the driver; a drain deferred behind transfers
keeps the deepest level asked for; a level outside 1-2 is refused."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.events import types as ev
from kvsched.reducers.inputs import MalformedInput

from .helpers import Harness, of_type, request


@pytest.mark.parametrize("level", [1, 2])
def test_a_drain_at_a_level_is_drained_at_that_level(level: int) -> None:
    h = Harness()
    h.step([request(0, 40, max_tokens=20)])
    result = h.step([ev.DrainRequested(level=level)])
    (drained,) = of_type(result.decisions, ev.Drained)
    assert drained.level == level and h.state.serving.sleep_level == level
    h.step([ev.WakeRequested()])
    assert not h.state.sleeping and h.state.serving.sleep_level == 0


def test_a_drain_deferred_behind_a_load_sleeps_at_the_deepest_level_asked_for() -> None:
    h = Harness(external_kv=True, block_size=4, max_prefill_tokens=8)
    h.step([request(0, np.arange(1, 13, dtype=np.int32), max_tokens=4)])  # a lookup
    h.step([ev.KVLookupAnswered(0, 2)])  # admitted to load chain blocks [0, 2)
    first = h.step([ev.DrainRequested(level=1)])
    again = h.step([ev.DrainRequested(level=1)])
    deeper = h.step([ev.DrainRequested(level=2)])
    assert [d.level for d in of_type(first.decisions, ev.DrainDeferred)] == [1]
    assert not of_type(again.decisions, ev.DrainDeferred)  # nothing new to defer
    assert [d.level for d in of_type(deeper.decisions, ev.DrainDeferred)] == [2]
    settled = h.step([ev.KVLoadFinished(0)])
    assert [d.level for d in of_type(settled.decisions, ev.Drained)] == [2]


@pytest.mark.parametrize("level", [0, 3, -1])
def test_a_drain_at_an_unknown_level_is_refused_and_nothing_changes(level: int) -> None:
    h = Harness()
    h.step([request(0, 40, max_tokens=20)])
    before = h.state.snapshot()
    with pytest.raises(MalformedInput, match="level"):
        h.engine.step([ev.DrainRequested(level=level)], 1.0)
    assert h.state.snapshot() == before


def test_a_drain_while_asleep_never_lightens_the_sleep() -> None:
    h = Harness()
    h.step([ev.DrainRequested(level=2)])
    result = h.step([ev.DrainRequested(level=1)])
    assert [d.level for d in of_type(result.decisions, ev.Drained)] == [2]
