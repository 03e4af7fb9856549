"""events/types.py: every event under one name space, split into inputs and decisions."""

from __future__ import annotations

import numpy as np

from kvsched.events import base, decisions, inputs, storage
from kvsched.events import types as ev


def test_every_event_struct_of_every_family_is_an_input_or_a_decision_never_both():
    structs = {
        v
        for m in (inputs, decisions, storage)
        for v in vars(m).values()
        if isinstance(v, type) and issubclass(v, base.Event) and v is not base.Event
    }
    assert set(ev.INPUT_TYPES) | set(ev.DECISION_TYPES) == structs
    assert not set(ev.INPUT_TYPES) & set(ev.DECISION_TYPES)
    assert {t.__name__ for t in structs} <= set(ev.__all__)


def test_the_inputs_come_from_inputs_py_and_the_decisions_from_the_two_decision_modules():
    assert {t.__module__ for t in ev.INPUT_TYPES} == {inputs.__name__}
    assert {t.__module__ for t in ev.DECISION_TYPES} == {decisions.__name__, storage.__name__}


def test_an_event_is_named_by_its_sequence_checkpoint_or_first_ids_else_the_engine():
    assert ev.entity_of(ev.RequestAborted(7, "x")) == "seq_id=7"
    many = ev.DecodeScheduled(np.arange(6, dtype=np.int64))
    assert ev.entity_of(many) == "seq_ids=[0,1,2,3...]"
    assert ev.entity_of(ev.CacheCleared()) == "engine"


def test_a_hash_blob_splits_into_its_16_byte_digests_in_order():
    blob = bytes(range(16)) + bytes(range(16, 32))
    assert ev.split_hashes(blob) == [bytes(range(16)), bytes(range(16, 32))]
    assert ev.split_hashes(b"") == []
