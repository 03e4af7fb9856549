"""The event log's file format: magic, frames, header, and how reading classifies damage.

File layout::

    MAGIC (8 bytes) | header frame | record frame | record frame | ...

A frame is a 12-byte prefix ``struct.pack('<III', length, crc32(payload),
crc32(prefix[:8]))`` followed by ``length`` payload bytes.  The header frame's
payload is msgpack of a dict with ``schema_version``, ``kvsched_version``,
``config`` and any extra keys.  Record payloads are opaque ``bytes``.

Frames are read one at a time from a file (:func:`read_frame`): memory follows the
largest frame, never the file.  The first frame that is not complete and intact
ends the log, and is classified:

* zero bytes from there to the end of the file (at least a prefix's worth) are
  *crash padding* (``ZeroPadding``): a file extended with zeros that were never
  written over (preallocation, or a crash before the data reached the disk);
* a frame cut by the end of the file, or whose missing part is zeros to the end of
  the file, is a *torn tail* (``TornTail``): a crash during an append;
* anything else is *corruption* (``CorruptLogError``, naming the frame's byte
  offset): a prefix checksum that fails, a payload checksum that fails, or a frame
  claiming more bytes than the file holds while a complete frame follows inside
  the bytes it claims (it is not the last frame, so it was not cut by a crash).
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO

import msgspec
import numpy as np

__all__ = [
    "HEADER_OFFSET",
    "MAGIC",
    "MAX_PAYLOAD",
    "PREFIX_SIZE",
    "CorruptLogError",
    "TornTail",
    "ZeroPadding",
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
_CHUNK = 1 << 20  # bytes read at a time when a scan does not keep what it reads
_BIG_FRAME = 1 << 26  # a frame this long has its checksum checked before it is kept


class CorruptLogError(Exception):
    """The log is damaged at ``offset`` (not merely cut short by a crash).

    ``steps`` is, when a verification raised it, how many steps before the damage
    it verified (None otherwise).
    """

    steps: int | None = None

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
    the 12-byte prefix the payload length is unknown, so it is a lower bound (and
    for a frame zero-filled to the end of the file it is the zero bytes' count).
    """

    offset: int
    missing_bytes: int
    reason: str


@dataclass(frozen=True, slots=True)
class ZeroPadding:
    """``length`` zero bytes from ``offset`` (just past the last complete frame) to the
    end of the file: crash padding, not a frame."""

    offset: int
    length: int


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


def read_frame(file: BinaryIO, offset: int, size: int, path: str) -> bytes | TornTail | ZeroPadding:
    """The payload of the frame at ``offset`` of ``file`` (``size`` bytes long), which
    must be positioned there; on success the file is left just past the frame. A frame
    that is not complete and intact is classified (see the module docstring): a
    ``TornTail``, a ``ZeroPadding``, or :class:`CorruptLogError` raised."""
    available = size - offset
    if available < PREFIX_SIZE:
        return _torn(file, offset, size, path, offset + PREFIX_SIZE)
    prefix = file.read(PREFIX_SIZE)
    length, payload_crc, prefix_crc = _PREFIX.unpack(prefix)
    if _crc32(prefix[:8]) != prefix_crc:
        why = "frame header is corrupt (prefix checksum mismatch)"
        return _damaged(file, offset, size, path, why)
    end = offset + PREFIX_SIZE + length
    if end > size:
        return _torn(file, offset, size, path, end)
    if length >= _BIG_FRAME and _stream_crc(file, offset + PREFIX_SIZE, end) != payload_crc:
        return _damaged(file, offset, size, path, "payload checksum mismatch", end)
    payload = file.read(length)
    if _crc32(payload) != payload_crc:
        return _damaged(file, offset, size, path, "payload checksum mismatch", end)
    return payload


def _torn(file: BinaryIO, offset: int, size: int, path: str, end: int) -> TornTail:
    """The frame at ``offset`` needs ``end - size`` more bytes than the file holds."""
    available = size - offset
    if available >= PREFIX_SIZE:
        zeros = _zero_tail_start(file, offset + PREFIX_SIZE, size)
        found = _find_frame(file, offset + PREFIX_SIZE, zeros, size)
        if found is not None:
            length = end - offset - PREFIX_SIZE
            why = (
                f"frame claims {length} bytes, {end - size} past the end of the file, "
                f"but a complete frame follows at byte {found}"
            )
            raise CorruptLogError(path, offset, why)
    if available < PREFIX_SIZE:
        reason = f"incomplete frame prefix ({available} of {PREFIX_SIZE} bytes)"
    else:
        have, need = available - PREFIX_SIZE, end - offset - PREFIX_SIZE
        reason = f"incomplete frame payload ({have} of {need} bytes)"
    return TornTail(offset, end - size, reason)


def _damaged(
    file: BinaryIO, offset: int, size: int, path: str, reason: str, end: int | None = None
) -> TornTail | ZeroPadding:
    """A prefix (``end`` None) or payload checksum failed: crash padding, a frame whose
    unwritten part is zeros to the end of the file (a torn tail), or corruption."""
    zeros = _zero_tail_start(file, offset, size)
    count = size - zeros
    if zeros == offset and count >= PREFIX_SIZE:
        return ZeroPadding(offset, count)
    frame_end = offset + PREFIX_SIZE if end is None else end
    if zeros < frame_end and count >= PREFIX_SIZE:
        why = f"incomplete frame: zero-filled from byte {zeros} to the end of the file"
        return TornTail(offset, count, f"{why} ({count} zero bytes of crash padding)")
    raise CorruptLogError(path, offset, reason)


def _zero_tail_start(file: BinaryIO, low: int, size: int) -> int:
    """The smallest ``z >= low`` with only zero bytes from ``z`` to ``size``."""
    stop = size
    while stop > low:
        start = max(low, stop - _CHUNK)
        file.seek(start)
        kept = len(file.read(stop - start).rstrip(b"\0"))
        if kept:
            return start + kept
        stop = start
    return low


def _stream_crc(file: BinaryIO, start: int, end: int) -> int:
    """crc32 of ``file[start:end]``, read a chunk at a time; leaves the file at ``start``."""
    file.seek(start)
    crc = 0
    for at in range(start, end, _CHUNK):
        crc = _crc32(file.read(min(_CHUNK, end - at)), crc)
    file.seek(start)
    return crc


def _window_tables() -> tuple[np.ndarray, int]:
    """crc32 of any 8 bytes is ``base ^ tables[0][b0] ^ ... ^ tables[7][b7]`` (crc32 is
    affine over GF(2) for a fixed length)."""
    base = _crc32(bytes(8))
    tables = np.zeros((8, 256), np.uint32)
    for i in range(8):
        for v in range(256):
            tables[i, v] = _crc32(bytes(i) + bytes([v]) + bytes(7 - i)) ^ base
    return tables, base


_TABLES: tuple[np.ndarray, int] | None = None


def _find_frame(file: BinaryIO, start: int, stop: int, size: int) -> int | None:
    """The first offset in ``[start, stop)`` where a complete, intact frame lies."""
    global _TABLES
    if _TABLES is None:
        _TABLES = _window_tables()
    tables, base = _TABLES
    at = start
    while at + PREFIX_SIZE <= stop:
        file.seek(at)
        chunk = np.frombuffer(file.read(min(_CHUNK, stop - at) + PREFIX_SIZE - 1), np.uint8)
        n = len(chunk) - PREFIX_SIZE + 1
        if n <= 0:
            break
        crc = np.full(n, base, np.uint32)
        for i in range(8):
            crc ^= tables[i][chunk[i : i + n]]
        stored = chunk[8 : 8 + n].astype(np.uint32)
        for i in range(1, 4):
            stored |= chunk[8 + i : 8 + i + n].astype(np.uint32) << (8 * i)
        for hit in np.flatnonzero(crc == stored).tolist():
            if _is_frame(file, at + hit, size):
                return at + hit
        at += n
    return None


def _is_frame(file: BinaryIO, offset: int, size: int) -> bool:
    file.seek(offset)
    length, payload_crc, _ = _PREFIX.unpack(file.read(PREFIX_SIZE))
    end: int = offset + PREFIX_SIZE + length
    return end <= size and _stream_crc(file, offset + PREFIX_SIZE, end) == int(payload_crc)


def count_records(file: BinaryIO, size: int) -> int:
    """Records in the log ``file`` (``size`` bytes), counted from the frames' length prefixes
    alone, without reading a payload (a cheap total, e.g. for a progress bar): it stops at the
    first prefix whose own checksum fails or whose frame runs past the end (a torn tail,
    zeros, damage). The first frame, the header, is not a record."""
    offset, frames = HEADER_OFFSET, 0
    while offset + PREFIX_SIZE <= size:
        file.seek(offset)
        prefix = file.read(PREFIX_SIZE)
        length, _, check = _PREFIX.unpack(prefix)
        offset += PREFIX_SIZE + length
        if check != _crc32(prefix[:8]) or offset > size:
            break
        frames += 1
    return max(frames - 1, 0)


# --------------------------------------------------------------------------- magic and header


def check_magic(file: BinaryIO, path: str) -> None:
    """Read and check the magic at the start of ``file`` (positioned at 0)."""
    found = file.read(len(MAGIC))
    if len(found) < len(MAGIC):
        raise CorruptLogError(path, 0, f"bad magic: file is only {len(found)} bytes long")
    if found != MAGIC:
        raise CorruptLogError(path, 0, f"bad magic: expected {MAGIC!r}, found {found!r}")


def read_header(file: BinaryIO, size: int, path: str) -> tuple[dict[str, Any], int]:
    """Decode the header frame (``file`` positioned just past the magic); return it and the
    offset of the first record."""
    frame = read_frame(file, HEADER_OFFSET, size, path)
    if isinstance(frame, TornTail | ZeroPadding):
        why = frame.reason if isinstance(frame, TornTail) else "zero bytes"
        raise CorruptLogError(path, HEADER_OFFSET, f"log has no complete header ({why})")
    try:
        header = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError as exc:
        raise CorruptLogError(path, HEADER_OFFSET, f"header is not valid msgpack: {exc}") from exc
    except RecursionError:
        raise CorruptLogError(path, HEADER_OFFSET, "header is nested too deeply") from None
    _validate_header(header, path)
    return header, HEADER_OFFSET + PREFIX_SIZE + len(frame)


def _validate_header(header: object, path: str) -> None:
    if not isinstance(header, dict):
        raise CorruptLogError(path, HEADER_OFFSET, "header is not a map")
    expected = {"schema_version": int, "kvsched_version": str, "config": dict}
    for key, kind in expected.items():
        if not isinstance(header.get(key), kind):
            raise CorruptLogError(path, HEADER_OFFSET, f"header field {key!r} missing or invalid")
