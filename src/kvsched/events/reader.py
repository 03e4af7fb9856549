"""Reading the event log: a frame at a time (``LogReader``, ``iter_log``) or all of it
(``read_log``). What a reader reports (torn tail, crash padding, corruption) is described in
``log.py``'s docstring; the file format is ``framing.py``'s."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

from kvsched.events.framing import (
    PREFIX_SIZE,
    StrPath,
    TornTail,
    ZeroPadding,
    check_magic,
    read_frame,
    read_header,
)

_READ_BUFFER = 1 << 20


@dataclass(frozen=True, slots=True)
class LogContents:
    """Everything :func:`read_log` found.

    ``size`` is the file size in bytes; ``valid_size`` is the offset just past
    the last complete record (equal to ``size`` unless the tail is torn or
    padded); ``padding`` is the count of zero bytes after it (crash padding).
    """

    header: dict[str, Any]
    records: list[bytes]
    offsets: list[int]
    torn_tail: TornTail | None
    size: int
    valid_size: int
    padding: int = 0


class LogRecord(NamedTuple):
    """One record: its frame's byte offset and its payload."""

    offset: int
    payload: bytes


# --------------------------------------------------------------------------- reading


class LogReader:
    """Reader: checks magic and header on construction, frames when iterated.

    Iterating reads the file one frame at a time (memory follows the largest record,
    not the file) and yields :class:`LogRecord` items; :meth:`read_all` collects them.
    ``torn_tail``, ``padding`` and ``valid_size`` are only known once a scan has
    finished; reading them earlier raises ``RuntimeError`` so an unfinished scan is
    never mistaken for a clean one. ``data`` reads those bytes instead of the file.
    """

    def __init__(self, path: StrPath, *, data: bytes | None = None) -> None:
        self.path = os.fspath(path)
        self._data = data
        with self._open() as file:
            self.size = _size(file)
            check_magic(file, self.path)
            self.header, self._first = read_header(file, self.size, self.path)
        self._end: int | None = None
        self._torn: TornTail | None = None
        self._padding = 0

    def _open(self) -> BinaryIO:
        if self._data is not None:
            return io.BytesIO(self._data)
        return open(self.path, "rb", buffering=_READ_BUFFER)

    def __iter__(self) -> Iterator[LogRecord]:
        path, offset = self.path, self._first
        with self._open() as file:
            size = self.size = _size(file)
            file.seek(offset)
            while offset < size:
                frame = read_frame(file, offset, size, path)
                if isinstance(frame, TornTail | ZeroPadding):
                    self._finish(offset, frame)
                    return
                yield LogRecord(offset, frame)
                offset += PREFIX_SIZE + len(frame)
        self._finish(offset, None)

    def read_all(self) -> tuple[list[bytes], list[int]]:
        """Return all complete records and their offsets."""
        records: list[bytes] = []
        offsets: list[int] = []
        for offset, payload in self:
            records.append(payload)
            offsets.append(offset)
        return records, offsets

    def _finish(self, end: int, stop: TornTail | ZeroPadding | None) -> None:
        self._end = end
        self._torn = stop if isinstance(stop, TornTail) else None
        self._padding = stop.length if isinstance(stop, ZeroPadding) else 0

    def _require_done(self) -> int:
        if self._end is None:
            raise RuntimeError("log not fully read yet: iterate the reader to the end first")
        return self._end

    @property
    def torn_tail(self) -> TornTail | None:
        """The incomplete last frame, if any (after a complete scan)."""
        self._require_done()
        return self._torn

    @property
    def padding(self) -> int:
        """Zero bytes after the last complete record (crash padding), after a complete scan."""
        self._require_done()
        return self._padding

    @property
    def valid_size(self) -> int:
        """Offset just past the last complete record (after a complete scan)."""
        return self._require_done()


def _size(file: BinaryIO) -> int:
    return file.seek(0, os.SEEK_END) - file.seek(0)


def iter_log(path: StrPath) -> LogReader:
    """Return a lazy :class:`LogReader` over ``path`` (iterate it for records)."""
    return LogReader(path)


def read_log(path: StrPath) -> LogContents:
    """Read the whole log into memory; raise :class:`CorruptLogError` on any damage."""
    reader = LogReader(path)
    records, offsets = reader.read_all()
    return LogContents(
        header=reader.header,
        records=records,
        offsets=offsets,
        torn_tail=reader.torn_tail,
        size=reader.size,
        valid_size=reader.valid_size,
        padding=reader.padding,
    )
