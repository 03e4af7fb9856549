"""Append-only, crash-tolerant framed record file (the event log): the one writer, and the
reader (``reader.py``, re-exported here). The file format (magic, frames, header) is
``framing.py``'s.

Reading goes one frame at a time (memory follows the largest record, not the file)
and never skips anything silently:

* an incomplete frame at end of file (a crash mid-append) is a *torn tail*:
  every complete record before it is returned and ``torn_tail`` describes it;
* zero bytes after the last complete record are crash padding (``padding``);
* a frame whose prefix checksum fails, or whose payload checksum fails, or that
  claims more bytes than the file holds while a complete frame follows, raises
  :class:`CorruptLogError` naming that frame's byte offset (``framing.py``).

The writer is single-process, single-thread; it is not safe to share.  A
writer holds an exclusive advisory lock (``flock(LOCK_EX | LOCK_NB)``) on the
file from :meth:`EventLog.create` or :meth:`EventLog.open_append` until
:meth:`EventLog.close`, so a second writer, in this process or another, fails
at once with :class:`LogLockedError` instead of silently interleaving frames.
``create`` takes the lock before truncating, so a refused ``create`` leaves the
holder's file intact.  Readers do not lock.  The lock is advisory: it binds
only writers that take it (every :class:`EventLog` does); it belongs to the
open file, so it is released when the writer's process dies (and shared with a
forked child that inherits the file).

A write that fails (a full disk, a file-size limit, an I/O error) never leaves a half
record behind: the writer cuts the file back to the end of the last record it flushed
completely, closes it and raises :class:`LogWriteError`; the log then reads as a clean
prefix of the run and verifies. ``close`` likewise drops a record that an interruption
(Ctrl-C) cut between its two writes.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import fcntl
import logging
import os
import stat
import struct
import zlib
from typing import Any, BinaryIO

import msgspec

from kvsched.events.closing import Closing
from kvsched.events.framing import (
    HEADER_OFFSET,
    MAGIC,
    PREFIX_SIZE,
    CorruptLogError,
    StrPath,
    TornTail,
    ZeroPadding,
    encode_frame,
    frame_prefix,
)
from kvsched.events.reader import LogContents, LogReader, LogRecord, iter_log, read_log

_WRITE_BUFFER = 1 << 16
_PREFIX = struct.Struct("<III")
_crc32 = zlib.crc32
_logger = logging.getLogger("kvsched.events.log")

__all__ = [
    "HEADER_OFFSET",
    "MAGIC",
    "PREFIX_SIZE",
    "CorruptLogError",
    "EventLog",
    "LogContents",
    "LogLockedError",
    "LogOpenError",
    "LogReader",
    "LogRecord",
    "LogWriteError",
    "TornTail",
    "ZeroPadding",
    "encode_frame",
    "iter_log",
    "read_log",
]

# --------------------------------------------------------------------------- errors


class LogOpenError(OSError):
    """The log file cannot be opened for writing."""

    def __init__(self, path: StrPath, reason: str, errno: int | None = None) -> None:
        super().__init__(errno, reason)
        self.path = os.fspath(path)
        self.reason = reason
        self.filename = self.path

    def __str__(self) -> str:
        return f"cannot write event log {self.path}: {self.reason}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.reason, self.errno))


class LogLockedError(LogOpenError):
    """Another writer holds the log's exclusive lock (it is open for writing elsewhere)."""

    def __init__(
        self,
        path: StrPath,
        reason: str = "another writer holds it (its exclusive lock is taken)",
        errno: int | None = _errno.EWOULDBLOCK,
    ) -> None:
        super().__init__(path, reason, errno)


class LogWriteError(OSError):
    """A write to an open log failed; the log was cut back to its last complete record
    (``steps`` records, ``size`` bytes: a clean prefix of the run) and closed."""

    def __init__(
        self, path: StrPath, reason: str, errno: int | None, steps: int, size: int
    ) -> None:
        super().__init__(errno, reason)
        self.path = os.fspath(path)
        self.reason = reason
        self.filename = self.path
        self.steps = steps
        self.size = size

    def __str__(self) -> str:
        return (
            f"cannot write event log {self.path}: {self.reason}; the log is closed and "
            f"verifiable up to its last complete step ({self.steps} steps, {self.size} bytes)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.reason, self.errno, self.steps, self.size))


def _close_and_cut(file: BinaryIO, size: int) -> None:
    """Close ``file`` after a failed write, dropping what it still buffers, and cut a regular
    file back to ``size`` bytes (a device is left as is)."""
    try:
        fd = os.dup(file.fileno())
    except (OSError, ValueError):  # no descriptor: nothing on disk to cut
        fd = -1
    with contextlib.suppress(OSError):
        file.close()  # retries the buffered bytes; whatever lands past ``size`` is cut below
    if fd < 0:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, size)
    except OSError:
        pass  # the cut failed: a torn tail remains, which readers report and skip
    finally:
        os.close(fd)


def _open_error(path: StrPath, exc: OSError) -> LogOpenError:
    return LogOpenError(path, exc.strerror or str(exc), exc.errno)


def _lock(fd: int, path: StrPath) -> None:
    """Take the writer's exclusive lock on ``fd`` without blocking, or raise."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise LogLockedError(path) from exc
    except OSError as exc:
        raise _open_error(path, exc) from exc


# --------------------------------------------------------------------------- writing


def _encode_header(
    schema_version: int, kvsched_version: str, config: dict[str, Any], extra: dict[str, Any]
) -> bytes:
    if isinstance(schema_version, bool) or not isinstance(schema_version, int):
        raise TypeError(f"schema_version must be an int, not {type(schema_version).__name__}")
    if not isinstance(kvsched_version, str):
        raise TypeError(f"kvsched_version must be a str, not {type(kvsched_version).__name__}")
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, not {type(config).__name__}")
    header = {
        **extra,
        "schema_version": schema_version,
        "kvsched_version": kvsched_version,
        "config": config,
    }
    return msgspec.msgpack.encode(header)


class EventLog(Closing):
    """Writer for an event log; use :meth:`create` or :meth:`open_append`."""

    def __init__(
        self,
        path: StrPath,
        file: BinaryIO,
        header: dict[str, Any],
        offset: int,
        recovered_tail: TornTail | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.header = header
        self.recovered_tail = recovered_tail
        self._file = file
        self._offset = offset
        self._records = 0  # records appended (one per step)
        self._flushed = offset  # the end of the last record known to be written out
        self._flushed_records = 0

    @classmethod
    def create(
        cls,
        path: StrPath,
        *,
        schema_version: int,
        kvsched_version: str,
        config: dict[str, Any],
        **extra: Any,
    ) -> EventLog:
        """Create (truncating) a log and write magic + header.

        The file is opened without truncation, locked, and only then truncated.
        Raises :class:`LogLockedError` (touching nothing) if another writer
        holds the log, :class:`LogOpenError` if ``path`` cannot be opened for
        writing, and ``TypeError`` (before touching the file) if the header
        cannot be encoded.
        """
        header_bytes = _encode_header(schema_version, kvsched_version, config, extra)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise _open_error(path, exc) from exc
        try:
            _lock(fd, path)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):  # as O_TRUNC: a device is left as is
                    os.ftruncate(fd, 0)
            except OSError as exc:
                raise _open_error(path, exc) from exc
            file = open(fd, "wb", buffering=_WRITE_BUFFER)  # noqa: SIM115 - owned by EventLog
        except BaseException:
            os.close(fd)
            raise
        try:
            file.write(MAGIC)
            file.write(encode_frame(header_bytes))
            file.flush()
        except OSError as exc:  # a full disk, /dev/full: an empty file, not half a header
            _close_and_cut(file, 0)
            raise _open_error(path, exc) from exc
        except BaseException:
            file.close()
            raise
        header = msgspec.msgpack.decode(header_bytes)
        return cls(path, file, header, HEADER_OFFSET + PREFIX_SIZE + len(header_bytes))

    @classmethod
    def open_append(cls, path: StrPath) -> EventLog:
        """Reopen an existing log for appending, cutting off a torn tail or crash padding first.

        The lock is taken before the log is read.  A cut tail is logged as a
        warning and kept in ``recovered_tail``.  Raises :class:`CorruptLogError`
        if the log is damaged (nothing is modified then),
        :class:`LogLockedError` if another writer holds it, and
        :class:`LogOpenError` if it cannot be opened.
        """
        try:
            file = open(path, "r+b", buffering=_WRITE_BUFFER)  # noqa: SIM115 - owned by EventLog
        except OSError as exc:
            raise _open_error(path, exc) from exc
        try:
            _lock(file.fileno(), path)
            reader = LogReader(path)  # a second descriptor: read a frame at a time
            records = sum(1 for _ in reader)
            end, torn = reader.valid_size, reader.torn_tail
            if torn is not None:
                _cut_tail(file, path, torn, end)
            elif reader.padding:
                _cut_padding(file, path, reader.padding, end)
            file.seek(end)
        except BaseException:
            file.close()
            raise
        log = cls(path, file, reader.header, end, recovered_tail=torn)
        log._records = log._flushed_records = records
        return log

    @property
    def offset(self) -> int:
        """Byte offset at which the next record will be written."""
        return self._offset

    @property
    def records(self) -> int:
        """Records appended so far (complete ones: one per engine step)."""
        return self._records

    @property
    def closed(self) -> bool:
        """Whether the log has been closed."""
        return self._file.closed

    def append(self, payload: bytes) -> int:
        """Append one record; return the byte offset of its frame."""
        if self._file.closed:
            raise ValueError(f"event log {self.path} is closed")
        if not isinstance(payload, bytes):
            payload = bytes(payload)
        offset = self._offset
        prefix = frame_prefix(payload)
        try:
            self._file.write(prefix)
            self._file.write(payload)
        except OSError as exc:
            raise self._failed(exc) from exc
        self._offset = offset + PREFIX_SIZE + len(payload)
        self._records += 1
        return offset

    def flush(self) -> None:
        """Push buffered records to the OS (:class:`LogWriteError` if that fails)."""
        try:
            self._file.flush()
        except OSError as exc:
            raise self._failed(exc) from exc
        self._flushed, self._flushed_records = self._offset, self._records

    def sync(self) -> None:
        """Flush and fsync, so records survive an OS crash."""
        self.flush()
        try:
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise self._failed(exc) from exc

    def close(self) -> None:
        """Flush and close, releasing the writer's lock; idempotent. A record cut short by
        an interruption (between its prefix and its payload) is dropped."""
        if self._file.closed:
            return
        self.flush()
        with contextlib.suppress(OSError, ValueError):  # not seekable: nothing to cut
            if self._file.tell() > self._offset and self._file.seekable():
                self._file.truncate(self._offset)
        self._file.close()

    def _failed(self, exc: OSError) -> LogWriteError:
        """Cut the log back to its last flushed record, close it, and describe why."""
        _close_and_cut(self._file, self._flushed)
        reason = exc.strerror or str(exc)
        return LogWriteError(self.path, reason, exc.errno, self._flushed_records, self._flushed)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"offset={self._offset}"
        return f"EventLog({self.path!r}, {state})"


def _cut_padding(file: BinaryIO, path: StrPath, length: int, end: int) -> None:
    _logger.warning(
        "event log %s: discarding %d zero bytes of crash padding at byte %d",
        os.fspath(path),
        length,
        end,
    )
    _truncate(file, end)


def _cut_tail(file: BinaryIO, path: StrPath, torn: TornTail, end: int) -> None:
    _logger.warning(
        "event log %s: discarding torn tail at byte %d (%s)",
        os.fspath(path),
        torn.offset,
        torn.reason,
    )
    _truncate(file, end)


def _truncate(file: BinaryIO, end: int) -> None:
    file.truncate(end)
    file.flush()
    os.fsync(file.fileno())
