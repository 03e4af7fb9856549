"""The field checks of inputs: the fast path of ``validate_inputs`` (every field exactly of its
declared type) gives the verdict of checking every field one by one (the same first offending
field named, or none)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.events import types as ev
from kvsched.reducers import inputs
from kvsched.reducers.state import EngineState

# Per declared field type: values every check accepts, and values some check refuses
# (out of range, not finite, a neighbouring type, a lone surrogate).
GOOD: dict[Any, list[Any]] = {
    int: [0, 7, -1, (1 << 63) - 1, -(1 << 63), np.int64(5)],
    float: [0.0, 1.5, -2.0, 3, np.float32(0.5)],
    str: ["", "lora-a", "sel\u00e9"],
    bool: [False, True, np.bool_(True)],
    bytes: [b"", b"x" * 16],
    np.ndarray: [np.arange(4, dtype=np.int32), np.zeros(0, np.int64)],
}
BAD: dict[Any, list[Any]] = {
    int: [1 << 63, -(1 << 63) - 1, True, 1.0, "3", None],
    float: [float("nan"), float("inf"), True, "0.5", None],
    str: [b"a", 3, "\ud800", None],
    bool: [1, 0, "yes", None],
    bytes: ["ab", bytearray(b"ab"), None],
    np.ndarray: [np.zeros((2, 2), np.int32), np.zeros(3, np.float32), [1, 2], None],
}
SPANS_GOOD = [(), (ev.MultimodalSpan(0, 4, b"h" * 16),)]
SPANS_BAD = [[], (1, 2), "span"]


def _one_by_one(event: ev.Event) -> str | None:
    """The reference: every declared field checked in order, by the general check (no fast
    path for the declared type)."""
    for name, kind in inputs._KINDS[type(event)]:
        reason = inputs._check_value(name, kind, getattr(event, name))
        if reason is not None:
            return reason
    return None


# A fresh state: no step awaits an outcome, no transfer is in flight.
STATE = EngineState(SchedulerConfig(model=ModelSpec(vocab_size=100, max_context=256)))


def _checked(event: ev.Event) -> str | None:
    """``validate_inputs``'s verdict on the fields of ``event``: the reason of the
    ``MalformedInput`` it raises, or None when the fields pass (the fresh state may refuse
    the input after them: an outcome of no step, a report of no transfer)."""
    try:
        inputs.validate_inputs(STATE, [event])
    except inputs.MalformedInput as err:
        return err.reason
    except inputs.InputError:
        return None
    return None


@st.composite
def events(draw: st.DrawFn) -> ev.Event:
    """An input event whose fields are all good but for at most one or two bad ones."""
    kind = draw(st.sampled_from((ev.RequestArrived,) * 4 + ev.INPUT_TYPES))
    fields = msgspec.structs.fields(kind)
    names = [f.name for f in fields]
    bad_fields = draw(st.sets(st.sampled_from(names), max_size=2)) if names else set()
    values = {}
    for field in fields:
        good, bad = (
            (SPANS_GOOD, SPANS_BAD)
            if field.type not in GOOD
            else (GOOD[field.type], BAD[field.type])
        )
        values[field.name] = draw(st.sampled_from(bad if field.name in bad_fields else good))
    return kind(**values)


@settings(max_examples=400, deadline=None)
@given(events())
def test_the_field_checks_name_the_same_first_offending_field_as_one_by_one_checks(
    event: ev.Event,
) -> None:
    reference = _one_by_one(event)
    reason = _checked(event)
    if reference is None:
        # (a type's own rules, after its fields; a lookup's count, checked with the state's)
        rules = ("temperature=", "block_hashes", "level", "num_blocks must be >= 0")
        assert reason is None or reason.startswith(rules)
    else:
        assert reason == reference


def test_a_well_formed_arrival_passes_the_field_checks() -> None:
    event = ev.RequestArrived(seq_id=1, prompt=np.arange(8, dtype=np.int32), max_tokens=4)
    assert _checked(event) is None


def test_each_bad_value_of_each_arrival_field_is_refused_naming_that_field() -> None:
    base = {"seq_id": 1, "prompt": np.arange(8, dtype=np.int32), "max_tokens": 4}
    for field in msgspec.structs.fields(ev.RequestArrived):
        for bad in BAD.get(field.type, SPANS_BAD):
            event = ev.RequestArrived(**{**base, field.name: bad})
            reason = _checked(event)
            assert reason is not None and reason == _one_by_one(event), (field.name, bad)
            assert field.name in reason
