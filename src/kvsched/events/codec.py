"""The wire schema: msgpack codec for events and step records, and its version.

Schema version 4 (``SCHEMA_VERSION``) encodes every event as a msgpack map of field names with
a ``type`` tag (fields at their default value omitted) and numpy arrays as msgpack ext 1
(dtype string, 4 bytes, then the raw little-endian data; 1-D only). A step record is a map
``{step, clock, inputs, decisions, plan}`` where ``plan`` is the step plan's digest
(``kvsched.plan.plan_digest``). Logs and published streams carry the version in their header:
``check_schema`` refuses a newer one, naming both versions, and reads an older one only
through an upcaster registered in ``UPCASTERS`` (none yet: version 1, positional arrays
without field names, is refused). Version 3 only added fields with defaults (a checkpoint's
placement rule and save phase, an eviction's priority) and two plan fields appended last, so
version 2 records decode as they are; a version-2 header's config ran the "lmdeploy"
checkpoint rules (``SchedulerConfig.from_log_header``). Version 4 added
``RequestArrived.block_hashes`` (default empty) and the ``kvs128`` block identity and plan
digest; a header before version 4 ran ``identity="blake2b"`` (block digests and plan
digests) and no minimum checkpoint gain, so older logs replay and verify as they were
written. Version 4 also added sleep levels (``DrainRequested``, ``DrainDeferred``,
``Drained``: ``level``, default 1) and cached-token counts (``SequenceFinished`` arrays and
``SequenceAborted`` fields, empty or 0 by default); a header before version 4 ran without
them (and without the alternate-mode triggers or decode preallocation).
``RequestArrived.reuse`` (the oracle's recorded future, default empty) came later without a
version change: a field with a default, omitted at it (events/README.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import msgspec
import numpy as np

from kvsched.events.types import DECISION_TYPES, INPUT_TYPES, Event

SCHEMA_VERSION = 4
OLDEST_READABLE = 2  # the oldest version this codec reads (directly or by upcasting)
_EXT_NDARRAY = 1

InputEvent = Union[INPUT_TYPES]  # type: ignore[valid-type]  # noqa: UP007
DecisionEvent = Union[DECISION_TYPES]  # type: ignore[valid-type]  # noqa: UP007

# version N -> a function turning a decoded (builtins) record of version N into version N + 1
UPCASTERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


class SchemaVersionError(ValueError):
    """A log or stream written in a schema version this kvsched cannot read."""

    def __init__(self, source: str, found: object) -> None:
        self.source = source
        self.found = found
        if isinstance(found, int) and found > SCHEMA_VERSION:
            why = (
                f"was written with event schema version {found}, newer than this kvsched's "
                f"schema version {SCHEMA_VERSION}: upgrade kvsched to read it"
            )
        elif isinstance(found, int):
            why = (
                f"was written with event schema version {found}; this kvsched writes version "
                f"{SCHEMA_VERSION} and reads versions {OLDEST_READABLE}..{SCHEMA_VERSION} "
                f"(record it again, or read it with the kvsched release that wrote it)"
            )
        else:
            why = f"has no valid schema version (found {found!r}; expected {SCHEMA_VERSION})"
        super().__init__(f"{source} {why}")


class RecordDecodeError(ValueError):
    """A framed record whose payload is not a valid step record of this schema."""


class StepRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """One framed log record: a step's inputs, the decisions the scheduler took, and the
    digest of the plan it handed to the executor."""

    step: int
    clock: float
    inputs: list[InputEvent]  # type: ignore[valid-type]
    decisions: list[DecisionEvent]  # type: ignore[valid-type]
    plan: bytes = b""


def check_schema(header: dict[str, Any], source: str) -> int:
    """The header's schema version, if this codec reads it; else SchemaVersionError."""
    version = header.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise SchemaVersionError(source, version)
    if not OLDEST_READABLE <= version <= SCHEMA_VERSION:
        raise SchemaVersionError(source, version)
    return version


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        if arr.ndim != 1:
            raise TypeError(f"only 1-D arrays are encoded, got shape {arr.shape}")
        return msgspec.msgpack.Ext(_EXT_NDARRAY, arr.dtype.str.encode().ljust(4) + arr.tobytes())
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _EXT_NDARRAY:
        raise ValueError(f"unknown msgpack extension type {code}")
    dtype = np.dtype(bytes(data[:4]).strip().decode())
    arr = np.frombuffer(bytes(data[4:]), dtype=dtype)
    return arr


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"cannot decode {typ!r} from {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_RECORD_DECODER = msgspec.msgpack.Decoder(StepRecord, ext_hook=_ext_hook, dec_hook=_dec_hook)
_EVENTS_DECODER = msgspec.msgpack.Decoder(
    list[Union[INPUT_TYPES + DECISION_TYPES]],  # type: ignore[misc]  # noqa: UP007
    ext_hook=_ext_hook,
    dec_hook=_dec_hook,
)


def encode(obj: Any) -> bytes:
    """Encode an event, a list of events or a step record."""
    return _ENCODER.encode(obj)


def decode_record(data: bytes) -> StepRecord:
    """Decode one step record; RecordDecodeError (with msgspec's reason) if it is not one."""
    try:
        return _RECORD_DECODER.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError, NotImplementedError) as exc:
        raise RecordDecodeError(f"not a step record of schema {SCHEMA_VERSION}: {exc}") from exc
    except RecursionError:
        raise RecordDecodeError("not a step record: nested too deeply to decode") from None


def decode_events(data: bytes) -> list[Event]:
    return list(_EVENTS_DECODER.decode(data))


def to_builtins(event: Event) -> dict[str, Any]:
    """A JSON-friendly view of an event (arrays become lists, bytes hex), for reports."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if isinstance(value, np.ndarray):
            value = value.tolist()
        elif isinstance(value, bytes):
            value = value.hex()
        elif isinstance(value, tuple):
            value = [_plain(v) for v in value]
        out[name] = value
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        return {k: _plain(getattr(value, k)) for k in value.__struct_fields__}
    return value.hex() if isinstance(value, bytes) else value
