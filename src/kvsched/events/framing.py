"""The event log's file format: magic, frames, header, and how reading classifies damage.

File layout::

    MAGIC (8 bytes) | header frame | record frame | record frame | ...

A frame is a 12-byte prefix ``struct.pack('<III', length, crc32(payload),
crc32(prefix[:8]))`` followed by ``length`` payload bytes.  The header frame's
payload is msgpack of a dict with ``schema_version``, ``kvsched_version``,
``config`` and any extra keys.  Record payloads are opaque ``bytes``.

An incomplete frame at end of file is a torn tail (``TornTail``); a checksum that
fails is corruption (``CorruptLogError``, naming the frame's byte offset).
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

__all__ = [
    "HEADER_OFFSET",
    "MAGIC",
    "MAX_PAYLOAD",
    "PREFIX_SIZE",
    "CorruptLogError",
    "TornTail",
    "check_magic",
    "encode_frame",
    "frame_prefix",
    "read_frame",
    "read_header",
]

StrPath = str | os.PathLike[str]

MAGIC = b"KVSLOG01"
HEADER_OFFSET = len(MAGIC)
PREFIX_SIZE = 12
MAX_PAYLOAD = 0xFFFF_FFFF

_PREFIX = struct.Struct("<III")
_PREFIX_HEAD = struct.Struct("<II")
_crc32 = zlib.crc32



class CorruptLogError(Exception):
    """The log is damaged at ``offset`` (not merely cut short by a crash)."""

    def __init__(self, path: StrPath, offset: int, reason: str) -> None:
        self.path = os.fspath(path)
        self.offset = offset
        self.reason = reason
        super().__init__(self.path, offset, reason)

    def __str__(self) -> str:
        return f"event log {self.path} is corrupt at byte {self.offset}: {self.reason}"


@dataclass(frozen=True, slots=True)
class TornTail:
    """An incomplete last frame starting at ``offset``.

    ``missing_bytes`` is how many more bytes the frame needed; for a cut inside
    the 12-byte prefix the payload length is unknown, so it is a lower bound.
    """

    offset: int
    missing_bytes: int
    reason: str


class _Frame(NamedTuple):
    start: int
    end: int


# --------------------------------------------------------------------------- framing


def encode_frame(payload: bytes) -> bytes:
    """Return the complete frame (prefix + payload) for ``payload``."""
    return frame_prefix(payload) + payload


def frame_prefix(payload: bytes) -> bytes:
    length = len(payload)
    if length > MAX_PAYLOAD:
        raise ValueError(f"payload of {length} bytes exceeds the {MAX_PAYLOAD}-byte frame limit")
    payload_crc = _crc32(payload)
    return _PREFIX.pack(length, payload_crc, _crc32(_PREFIX_HEAD.pack(length, payload_crc)))


def read_frame(buf: memoryview, offset: int, path: str) -> _Frame | TornTail:
    """Parse the frame at ``offset``; raise on corruption, return TornTail if cut."""
    size = len(buf)
    available = size - offset
    if available < PREFIX_SIZE:
        reason = f"incomplete frame prefix ({available} of {PREFIX_SIZE} bytes)"
        return TornTail(offset, PREFIX_SIZE - available, reason)
    length, payload_crc, prefix_crc = _PREFIX.unpack_from(buf, offset)
    if _crc32(buf[offset : offset + 8]) != prefix_crc:
        raise CorruptLogError(path, offset, "frame header is corrupt (prefix checksum mismatch)")
    start = offset + PREFIX_SIZE
    end = start + length
    if end > size:
        reason = f"incomplete frame payload ({size - start} of {length} bytes)"
        return TornTail(offset, end - size, reason)
    if _crc32(buf[start:end]) != payload_crc:
        raise CorruptLogError(path, offset, "payload checksum mismatch")
    return _Frame(start, end)


def check_magic(buf: memoryview, path: str) -> None:
    if len(buf) < len(MAGIC):
        raise CorruptLogError(path, 0, f"bad magic: file is only {len(buf)} bytes long")
    found = bytes(buf[: len(MAGIC)])
    if found != MAGIC:
        raise CorruptLogError(path, 0, f"bad magic: expected {MAGIC!r}, found {found!r}")


def read_header(buf: memoryview, path: str) -> tuple[dict[str, Any], int]:
    """Decode the header frame; return it and the offset of the first record."""
    frame = read_frame(buf, HEADER_OFFSET, path)
    if isinstance(frame, TornTail):
        raise CorruptLogError(path, HEADER_OFFSET, f"log has no complete header ({frame.reason})")
    try:
        header = msgspec.msgpack.decode(buf[frame.start : frame.end])
    except msgspec.DecodeError as exc:
        raise CorruptLogError(path, HEADER_OFFSET, f"header is not valid msgpack: {exc}") from exc
    except RecursionError:
        raise CorruptLogError(path, HEADER_OFFSET, "header is nested too deeply") from None
    _validate_header(header, path)
    return header, frame.end


def _validate_header(header: object, path: str) -> None:
    if not isinstance(header, dict):
        raise CorruptLogError(path, HEADER_OFFSET, "header is not a map")
    expected = {"schema_version": int, "kvsched_version": str, "config": dict}
    for key, kind in expected.items():
        if not isinstance(header.get(key), kind):
            raise CorruptLogError(path, HEADER_OFFSET, f"header field {key!r} missing or invalid")
