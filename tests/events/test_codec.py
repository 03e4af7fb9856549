"""The msgpack codec: every event type and StepRecord round-trip, arrays keep their dtype."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from kvsched.events import types as ev
from kvsched.events.codec import (
    SCHEMA_VERSION,
    RecordDecodeError,
    SchemaVersionError,
    StepRecord,
    check_schema,
    decode_events,
    decode_record,
    encode,
    to_builtins,
)


def i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


SPAN = ev.MultimodalSpan(2, 6, b"\x00\xffimage-hash")
H1, H2 = b"\x01" * 16, b"\x02" * 15 + b"\x00"  # two block hashes (one ends in a NUL byte)
H12, H21 = H1 + H2, H2 + H1

# One instance of every event type, with non-default values for every field.
SAMPLES: dict[type[ev.Event], ev.Event] = {
    # inputs
    ev.RequestArrived: ev.RequestArrived(
        seq_id=2**40 + 3,
        prompt=i32(1, 2, 3, 2**31 - 1, 0, 9, 8),
        max_tokens=17,
        arrival_time=1.25,
        priority=-2,
        session_id=11,
        adapter="lora-a",
        cache_salt="salt",
        eos_token_id=2,
        temperature=0.7,
        seed=2**63 - 1,
        mm_spans=(SPAN, ev.MultimodalSpan(0, 1, b"")),
    ),
    ev.RequestAborted: ev.RequestAborted(5, "client went away"),
    ev.SessionEnded: ev.SessionEnded(11),
    ev.DrainRequested: ev.DrainRequested(),
    ev.WakeRequested: ev.WakeRequested(),
    ev.AdmissionsHeld: ev.AdmissionsHeld(held=False),
    ev.StepExecuted: ev.StepExecuted(9, i64(1, 2**40, 3), i32(4, 5, 6), 0.0125),
    ev.StepFailed: ev.StepFailed(9, "CUDA error: out of memory"),
    ev.KVLookupAnswered: ev.KVLookupAnswered(4, 12, pending=True),
    ev.KVLoadFinished: ev.KVLoadFinished(4),
    ev.KVLoadFailed: ev.KVLoadFailed(4, 3, "remote store timed out"),
    ev.KVSaveFinished: ev.KVSaveFinished(77, ok=False),
    ev.KVHoldRequested: ev.KVHoldRequested(7, 3),
    ev.KVHoldReleased: ev.KVHoldReleased(7),
    # decisions
    ev.StepStarted: ev.StepStarted(3, 0.5),
    ev.RequestRejected: ev.RequestRejected(6, "empty prompt"),
    ev.SequenceAdmitted: ev.SequenceAdmitted(6, 3),
    ev.PrefixMatched: ev.PrefixMatched(6, i32(10, 11, 12), 192, 200),
    ev.BlocksAllocated: ev.BlocksAllocated(i64(1, 2), i32(2, 1), i32(30, 31, 32)),
    ev.BlocksFreed: ev.BlocksFreed(i64(-12, 4), i32(1, 2), i32(7, 8, 9)),
    ev.BlocksCached: ev.BlocksCached(
        i64(1, 2), i32(1, 1), i32(0, 3), i32(5, 6), i32(0, 9), H12, H21,
        np.array([True, False]), np.arange(8, dtype=np.int16),
    ),
    ev.BlocksEvicted: ev.BlocksEvicted(i32(5, 6), H12),
    ev.CacheCleared: ev.CacheCleared(),
    ev.SessionBlocksHeld: ev.SessionBlocksHeld(11, 6, i32(10, 11)),
    ev.PrefillScheduled: ev.PrefillScheduled(i64(1, 2), i64(0, 64), i64(64, 100)),
    ev.DecodeScheduled: ev.DecodeScheduled(i64(3, 4, 5)),
    ev.SequencePreempted: ev.SequencePreempted(6, "drain"),
    ev.SequenceFinished: ev.SequenceFinished(i64(1, 2), ("length", "stop")),
    ev.SequenceAborted: ev.SequenceAborted(6, "session ended"),
    ev.SessionClosed: ev.SessionClosed(11),
    ev.Drained: ev.Drained(),
    ev.Woken: ev.Woken(),
    ev.CheckpointReserved: ev.CheckpointReserved(1, 6, 2, 130, H1, H2, 17),
    ev.CheckpointPublished: ev.CheckpointPublished(1),
    ev.CheckpointPinned: ev.CheckpointPinned(1, 6),
    ev.CheckpointUnpinned: ev.CheckpointUnpinned(1, 6),
    ev.CheckpointAbandoned: ev.CheckpointAbandoned(1, "step failed"),
    ev.CheckpointReleased: ev.CheckpointReleased(1, "drain"),
    ev.CheckpointEvicted: ev.CheckpointEvicted(1),
    ev.KVLookupStarted: ev.KVLookupStarted(6, 2, 4, H2, H12, True),
    ev.KVLoadCancelled: ev.KVLoadCancelled(6, "drain"),
    ev.KVLoadAdmitted: ev.KVLoadAdmitted(6, 3, 2, 6),
    ev.KVLoadStarted: ev.KVLoadStarted(6, i32(40, 41), 2, H2, H12, 4, H2),
    ev.KVLoadSettled: ev.KVLoadSettled(6, 5),
    ev.KVSaveStarted: ev.KVSaveStarted(77, 6, i32(40, 41), 0, H2, H12, 3, 300),
    ev.AbortDeferred: ev.AbortDeferred(6, "session ended", True),
    ev.DrainDeferred: ev.DrainDeferred(),
    ev.PrefillTurnChosen: ev.PrefillTurnChosen("long_first", fallback=True),
}

ALL_TYPES = ev.INPUT_TYPES + ev.DECISION_TYPES


def assert_same_event(a: ev.Event, b: ev.Event) -> None:
    """Field-by-field equality; arrays must match in values *and* dtype."""
    assert type(a) is type(b)
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray), name
            assert y.dtype == x.dtype, (name, x.dtype, y.dtype)
            assert y.shape == x.shape and np.array_equal(x, y), name
        else:
            assert type(y) is type(x) and y == x, name


def test_the_samples_cover_every_input_and_decision_type_exactly_once():
    assert len(set(ALL_TYPES)) == len(ALL_TYPES)
    assert set(SAMPLES) == set(ALL_TYPES)
    assert all(type(e) is t for t, e in SAMPLES.items())


@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda t: t.__name__)
def test_every_event_type_round_trips_through_encode_and_decode_events(kind: type[ev.Event]):
    event = SAMPLES[kind]

    (decoded,) = decode_events(encode([event]))

    assert_same_event(event, decoded)
    assert encode(decoded) == encode(event)


def test_a_mixed_list_of_every_event_decodes_in_order():
    events = [SAMPLES[t] for t in ALL_TYPES]

    decoded = decode_events(encode(events))

    assert len(decoded) == len(events)
    for a, b in zip(events, decoded, strict=True):
        assert_same_event(a, b)


def test_distinct_event_types_have_distinct_tags():
    tags = [t.__struct_config__.tag for t in ALL_TYPES]
    assert len(set(tags)) == len(tags)


def test_a_step_record_round_trips_with_its_inputs_and_decisions():
    record = StepRecord(
        step=42,
        clock=3.5,
        inputs=[SAMPLES[t] for t in ev.INPUT_TYPES],
        decisions=[SAMPLES[t] for t in ev.DECISION_TYPES],
    )

    decoded = decode_record(encode(record))

    assert (decoded.step, decoded.clock) == (42, 3.5)
    assert [type(e) for e in decoded.inputs] == list(ev.INPUT_TYPES)
    assert [type(e) for e in decoded.decisions] == list(ev.DECISION_TYPES)
    pairs = zip(record.inputs + record.decisions, decoded.inputs + decoded.decisions, strict=True)
    for a, b in pairs:
        assert_same_event(a, b)
    assert encode(decoded) == encode(record)


def test_an_empty_step_record_round_trips():
    decoded = decode_record(encode(StepRecord(1, 0.0, [], [])))
    assert decoded == StepRecord(1, 0.0, [], [])


def test_a_step_record_with_a_decision_among_its_inputs_does_not_decode():
    bad = StepRecord(1, 0.0, [ev.StepStarted(1, 0.0)], [])  # type: ignore[list-item]
    with pytest.raises(RecordDecodeError, match="inputs"):
        decode_record(encode(bad))


def test_events_are_maps_of_field_names_with_defaults_left_out():
    raw = msgspec.msgpack.decode(encode(ev.KVSaveFinished(7)))
    assert raw == {"type": "kv_save_done", "save_id": 7}
    raw = msgspec.msgpack.decode(encode(ev.RequestAborted(3, "gone")))
    assert raw == {"type": "aborted", "seq_id": 3, "reason": "gone"}


def test_a_step_record_carries_its_plan_digest_by_name():
    raw = msgspec.msgpack.decode(encode(StepRecord(4, 1.5, [], [], b"\x01" * 8)))
    assert raw == {"step": 4, "clock": 1.5, "inputs": [], "decisions": [], "plan": b"\x01" * 8}


@pytest.mark.parametrize("version", [1, SCHEMA_VERSION + 1, 99, "3", None])
def test_a_header_of_another_schema_version_is_refused_naming_both_versions(version: object):
    with pytest.raises(SchemaVersionError) as info:
        check_schema({"schema_version": version}, "log x.kvlog")
    message = str(info.value)
    assert message.startswith("log x.kvlog")
    assert (str(SCHEMA_VERSION) in message and repr(version) in message) or str(version) in message
    if isinstance(version, int) and version > SCHEMA_VERSION:
        assert "newer" in message and "upgrade" in message


def test_a_header_of_this_schema_version_is_accepted():
    assert check_schema({"schema_version": SCHEMA_VERSION}, "log") == SCHEMA_VERSION


@pytest.mark.parametrize(
    "dtype", [np.int32, np.int64, np.uint64, np.int8, np.float32, np.float64, np.bool_]
)
def test_arrays_keep_their_dtype_and_values(dtype: type):
    values = np.array([0, 1, 1, 0, 1], dtype=dtype)
    (decoded,) = decode_events(encode([ev.DecodeScheduled(values)]))
    assert decoded.seq_ids.dtype == np.dtype(dtype)  # type: ignore[attr-defined]
    assert decoded.seq_ids.tolist() == values.tolist()  # type: ignore[attr-defined]


def test_int32_and_int64_arrays_with_the_same_values_stay_distinct():
    a = ev.DecodeScheduled(i32(1, 2, 3))
    b = ev.DecodeScheduled(i64(1, 2, 3))
    assert encode(a) != encode(b)
    (da, db) = decode_events(encode([a, b]))
    assert da.seq_ids.dtype == np.int32 and db.seq_ids.dtype == np.int64  # type: ignore[attr-defined]


def test_empty_and_extreme_valued_arrays_round_trip():
    event = ev.BlocksFreed(
        np.zeros(0, np.int64),
        np.zeros(0, np.int32),
        i32(np.iinfo(np.int32).min, np.iinfo(np.int32).max),
    )
    (decoded,) = decode_events(encode([event]))
    assert_same_event(event, decoded)


def test_a_non_contiguous_array_is_encoded_as_its_values():
    strided = np.arange(10, dtype=np.int64)[::3]
    assert not strided.flags.c_contiguous
    (decoded,) = decode_events(encode([ev.DecodeScheduled(strided)]))
    assert decoded.seq_ids.tolist() == [0, 3, 6, 9]  # type: ignore[attr-defined]


def test_a_two_dimensional_array_is_refused_at_encoding():
    with pytest.raises(TypeError, match="1-D"):
        encode(ev.DecodeScheduled(np.zeros((2, 2), np.int64)))


def test_numpy_scalars_in_integer_fields_encode_as_plain_numbers():
    event = ev.SequenceAdmitted(np.int64(6), np.int32(3))  # type: ignore[arg-type]
    (decoded,) = decode_events(encode([event]))
    assert encode(decoded) == encode(ev.SequenceAdmitted(6, 3))


def test_a_numpy_float_in_a_float_field_encodes_as_a_plain_float():
    (decoded,) = decode_events(encode([ev.StepStarted(1, np.float32(0.5))]))  # type: ignore[arg-type]
    assert encode(decoded) == encode(ev.StepStarted(1, 0.5))


def test_an_unencodable_value_is_refused_naming_its_type():
    with pytest.raises(NotImplementedError, match="cannot encode object"):
        encode(ev.RequestRejected(1, object()))  # type: ignore[arg-type]


def test_an_unknown_msgpack_extension_is_refused_at_decoding():
    data = msgspec.msgpack.encode([ev.DecodeScheduled(msgspec.msgpack.Ext(7, b"<i8 "))])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown msgpack extension type 7"):
        decode_events(data)


def test_a_recorded_future_round_trips_and_an_arrival_without_one_encodes_as_before():
    plain = ev.RequestArrived(3, i32(1, 2, 3), 4)
    future = ev.RequestArrived(3, i32(1, 2, 3), 4, reuse=((64, 9), (128, 2**40)))

    (decoded,) = decode_events(encode([future]))

    assert decoded.reuse == ((64, 9), (128, 2**40))
    assert b"reuse" not in encode(plain)  # (omitted at its default: older logs read the same)
    json.dumps(to_builtins(future))


def test_to_builtins_gives_plain_json_friendly_values():
    view = to_builtins(SAMPLES[ev.RequestArrived])
    assert view["type"] == "RequestArrived"
    assert view["prompt"] == [1, 2, 3, 2**31 - 1, 0, 9, 8]
    assert [(s["start"], s["end"]) for s in view["mm_spans"]] == [(2, 6), (0, 1)]
    for kind in ALL_TYPES:
        json.dumps(to_builtins(SAMPLES[kind]))  # raises on arrays, bytes or structs
