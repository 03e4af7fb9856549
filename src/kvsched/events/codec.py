"""msgpack codec for events and step records (msgspec; numpy arrays as msgpack ext 1)."""

from __future__ import annotations

from typing import Any, Union

import msgspec
import numpy as np

from kvsched.events.types import DECISION_TYPES, INPUT_TYPES, Event

_EXT_NDARRAY = 1

InputEvent = Union[INPUT_TYPES]  # type: ignore[valid-type]  # noqa: UP007
DecisionEvent = Union[DECISION_TYPES]  # type: ignore[valid-type]  # noqa: UP007


class StepRecord(msgspec.Struct, frozen=True, array_like=True):
    """One framed log record: a step's inputs and the decisions the scheduler took."""

    step: int
    clock: float
    inputs: list[InputEvent]  # type: ignore[valid-type]
    decisions: list[DecisionEvent]  # type: ignore[valid-type]


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        if arr.ndim != 1:
            raise TypeError(f"only 1-D arrays are encoded, got shape {arr.shape}")
        return msgspec.msgpack.Ext(_EXT_NDARRAY, arr.dtype.str.encode().ljust(4) + arr.tobytes())
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
    return _RECORD_DECODER.decode(data)


def decode_events(data: bytes) -> list[Event]:
    return list(_EVENTS_DECODER.decode(data))


def to_builtins(event: Event) -> dict[str, Any]:
    """A JSON-friendly view of an event (arrays become lists), for reports."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if isinstance(value, np.ndarray):
            value = value.tolist()
        elif isinstance(value, tuple):
            value = [msgspec.to_builtins(v) if isinstance(v, msgspec.Struct) else v for v in value]
        out[name] = value
    return out
