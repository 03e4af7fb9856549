"""Tests for the framed, crash-tolerant event log."""

from __future__ import annotations

import errno
import io
import os
import pickle
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsched.events.log import (
    HEADER_OFFSET,
    MAGIC,
    PREFIX_SIZE,
    CorruptLogError,
    EventLog,
    LogLockedError,
    LogOpenError,
    LogWriteError,
    TornTail,
    encode_frame,
    iter_log,
    read_log,
)

CONFIG = {"policy": "fcfs", "blocks": 128, "nested": {"a": [1, 2.5, "x"]}}
PAYLOADS = [b"first", b"", b"x" * 300, bytes(range(256)), b"last"]


def write_log(path: Path, payloads: list[bytes]) -> list[int]:
    with EventLog.create(path, schema_version=3, kvsched_version="0.1.0", config=CONFIG) as log:
        return [log.append(p) for p in payloads]


Scan = Callable[[Path], tuple[list[bytes], list[int], TornTail | None]]


def scan_with_read_log(path: Path) -> tuple[list[bytes], list[int], TornTail | None]:
    contents = read_log(path)
    return contents.records, contents.offsets, contents.torn_tail


def scan_with_iter_log(path: Path) -> tuple[list[bytes], list[int], TornTail | None]:
    reader = iter_log(path)
    records = list(reader)
    return [r.payload for r in records], [r.offset for r in records], reader.torn_tail


both_readers = pytest.mark.parametrize(
    "scan", [scan_with_read_log, scan_with_iter_log], ids=["read_log", "iter_log"]
)


def header_end(path: Path) -> int:
    """Offset of the first record frame in a log written by ``write_log``."""
    data = path.read_bytes()
    length: int = struct.unpack_from("<I", data, HEADER_OFFSET)[0]
    return HEADER_OFFSET + PREFIX_SIZE + length


# --------------------------------------------------------------------------- round trip


def test_header_and_records_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)

    contents = read_log(path)

    assert contents.header == {"schema_version": 3, "kvsched_version": "0.1.0", "config": CONFIG}
    assert contents.records == PAYLOADS
    assert contents.offsets == offsets
    assert contents.torn_tail is None
    assert contents.size == contents.valid_size == path.stat().st_size


def test_file_starts_with_magic_and_framed_header(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    write_log(path, [])
    data = path.read_bytes()

    assert data[:8] == MAGIC
    length, payload_crc, prefix_crc = struct.unpack_from("<III", data, 8)
    payload = data[20 : 20 + length]
    assert zlib.crc32(payload) == payload_crc
    assert zlib.crc32(data[8:16]) == prefix_crc
    assert msgspec.msgpack.decode(payload)["schema_version"] == 3
    assert len(data) == 20 + length


def test_extra_header_keys_are_stored(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    EventLog.create(
        path, schema_version=1, kvsched_version="9", config={}, seed=7, model="m"
    ).close()

    assert read_log(path).header == {
        "schema_version": 1,
        "kvsched_version": "9",
        "config": {},
        "seed": 7,
        "model": "m",
    }


def test_append_returns_offset_of_each_frame(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    data = path.read_bytes()

    for offset, payload in zip(offsets, PAYLOADS, strict=True):
        assert data[offset : offset + PREFIX_SIZE + len(payload)] == encode_frame(payload)


def test_iter_log_yields_records_and_reports_tail_after_iteration(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    with path.open("ab") as f:
        f.write(b"\x01\x02")

    reader = iter_log(path)
    with pytest.raises(RuntimeError):
        _ = reader.torn_tail
    records = list(reader)

    assert [r.payload for r in records] == PAYLOADS
    assert [r.offset for r in records] == offsets
    assert reader.torn_tail is not None
    assert reader.torn_tail.offset == path.stat().st_size - 2


def test_header_that_cannot_be_encoded_raises_type_error_without_touching_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.kvlog"
    with pytest.raises(TypeError):
        EventLog.create(path, schema_version=1, kvsched_version="0", config={"x": object()})
    assert not path.exists()


def test_append_after_close_raises(tmp_path: Path) -> None:
    log = EventLog.create(tmp_path / "a.kvlog", schema_version=1, kvsched_version="0", config={})
    log.close()
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.append(b"x")


def test_flush_makes_records_readable_while_log_is_open(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    log = EventLog.create(path, schema_version=1, kvsched_version="0", config={})
    log.append(b"one")
    log.flush()

    assert read_log(path).records == [b"one"]
    log.close()


# --------------------------------------------------------------------------- torn tails


@both_readers
def test_torn_tail_at_every_cut_of_last_frame_keeps_complete_records(
    tmp_path: Path, scan: Scan
) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    data = path.read_bytes()
    last = offsets[-1]
    cut_path = tmp_path / "cut.kvlog"

    for cut in range(last + 1, len(data)):
        cut_path.write_bytes(data[:cut])
        records, record_offsets, torn = scan(cut_path)

        assert records == PAYLOADS[:-1], cut
        assert record_offsets == offsets[:-1]
        assert torn is not None
        assert torn.offset == last
        assert torn.missing_bytes >= 1
        if cut - last >= PREFIX_SIZE:
            assert torn.missing_bytes == len(data) - cut


def test_read_log_reports_sizes_of_a_torn_log(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    path.write_bytes(path.read_bytes()[:-1])

    contents = read_log(path)

    assert contents.valid_size == offsets[-1]
    assert contents.size == path.stat().st_size


def test_cut_exactly_at_frame_boundary_is_not_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    path.write_bytes(path.read_bytes()[: offsets[-1]])

    contents = read_log(path)

    assert contents.records == PAYLOADS[:-1]
    assert contents.torn_tail is None


def test_log_cut_inside_header_has_no_complete_header(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    write_log(path, [])
    data = path.read_bytes()

    for cut in range(len(MAGIC), len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(CorruptLogError, match="no complete header") as info:
            read_log(path)
        assert info.value.offset == HEADER_OFFSET


# --------------------------------------------------------------------------- corruption


@both_readers
def test_any_flipped_byte_in_middle_frame_raises_corrupt_at_that_frame(
    tmp_path: Path, scan: Scan
) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    data = path.read_bytes()
    middle = 2
    start, end = offsets[middle], offsets[middle + 1]
    bad_path = tmp_path / "bad.kvlog"

    for pos in range(start, end):
        damaged = bytearray(data)
        damaged[pos] ^= 0xFF
        bad_path.write_bytes(bytes(damaged))

        with pytest.raises(CorruptLogError) as info:
            scan(bad_path)

        assert info.value.offset == start, pos
        expected = "frame header is corrupt" if pos < start + PREFIX_SIZE else "payload checksum"
        assert expected in info.value.reason


def test_corrupt_complete_last_frame_is_not_treated_as_torn(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0x01
    path.write_bytes(bytes(damaged))

    with pytest.raises(CorruptLogError, match="payload checksum mismatch") as info:
        read_log(path)
    assert info.value.offset == offsets[-1]


def test_corrupted_length_field_in_last_frame_is_corrupt_not_torn(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    damaged = bytearray(path.read_bytes())
    damaged[offsets[-1] + 3] = 0x7F  # length now far past end of file
    path.write_bytes(bytes(damaged))

    with pytest.raises(CorruptLogError, match="frame header is corrupt") as info:
        read_log(path)
    assert info.value.offset == offsets[-1]


def test_corrupt_header_frame_raises_with_header_offset(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    write_log(path, [b"a"])
    damaged = bytearray(path.read_bytes())
    damaged[HEADER_OFFSET + PREFIX_SIZE + 1] ^= 0x10
    path.write_bytes(bytes(damaged))

    with pytest.raises(CorruptLogError, match="payload checksum") as info:
        read_log(path)
    assert info.value.offset == HEADER_OFFSET


def test_header_payload_that_is_not_a_header_map_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    path.write_bytes(MAGIC + encode_frame(msgspec.msgpack.encode([1, 2])))

    with pytest.raises(CorruptLogError, match="not a map"):
        read_log(path)


@pytest.mark.parametrize(
    "content", [b"", b"KVS", b"KVSLOG02" + b"\x00" * 40, b"NOTALOG!"], ids=repr
)
def test_short_or_wrong_magic_raises_bad_magic_at_offset_zero(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "run.kvlog"
    path.write_bytes(content)

    with pytest.raises(CorruptLogError, match="bad magic") as info:
        read_log(path)
    assert info.value.offset == 0


def test_corrupt_log_error_message_names_path_offset_and_reason() -> None:
    err = CorruptLogError("run.kvlog", 1234, "payload checksum mismatch")

    assert str(err) == "event log run.kvlog is corrupt at byte 1234: payload checksum mismatch"
    assert (err.path, err.offset, err.reason) == ("run.kvlog", 1234, "payload checksum mismatch")
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


# --------------------------------------------------------------------------- opening


def test_create_in_missing_directory_raises_log_open_error_without_creating(
    tmp_path: Path,
) -> None:
    path = tmp_path / "missing" / "run.kvlog"

    with pytest.raises(LogOpenError) as info:
        EventLog.create(path, schema_version=1, kvsched_version="0", config={})

    assert str(info.value) == f"cannot write event log {path}: No such file or directory"
    assert isinstance(info.value, OSError)
    assert not (tmp_path / "missing").exists()


def test_create_on_a_directory_raises_log_open_error(tmp_path: Path) -> None:
    with pytest.raises(LogOpenError, match=f"cannot write event log {tmp_path}: ") as info:
        EventLog.create(tmp_path, schema_version=1, kvsched_version="0", config={})

    assert info.value.path == str(tmp_path)
    assert tmp_path.is_dir()
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_create_in_read_only_directory_raises_permission_denied(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(LogOpenError, match="Permission denied"):
            EventLog.create(tmp_path / "x.kvlog", schema_version=1, kvsched_version="0", config={})
    finally:
        tmp_path.chmod(0o700)


def test_open_append_after_torn_tail_truncates_and_continues(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    data = path.read_bytes()
    path.write_bytes(data[: offsets[-1] + 7])

    with EventLog.open_append(path) as log:
        assert log.recovered_tail is not None
        assert log.recovered_tail.offset == offsets[-1]
        assert log.offset == offsets[-1]
        new_offset = log.append(b"after-recovery")
    contents = read_log(path)

    assert new_offset == offsets[-1]
    assert contents.records == [*PAYLOADS[:-1], b"after-recovery"]
    assert contents.torn_tail is None
    assert contents.header["config"] == CONFIG
    assert "torn tail" in caplog.text


def test_open_append_after_crash_padding_cuts_the_zeros_and_leaves_a_clean_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "run.kvlog"
    write_log(path, PAYLOADS)
    size = path.stat().st_size
    with path.open("ab") as file:
        file.write(bytes(4096))

    with EventLog.open_append(path) as log:
        assert log.append(b"after-padding") == size
    contents = read_log(path)

    assert contents.records == [*PAYLOADS, b"after-padding"]
    assert contents.torn_tail is None
    assert contents.padding == 0
    assert "crash padding" in caplog.text


def test_open_append_on_clean_log_appends_after_last_record(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    write_log(path, PAYLOADS)
    size = path.stat().st_size

    with EventLog.open_append(path) as log:
        assert log.recovered_tail is None
        assert log.append(b"more") == size

    assert read_log(path).records == [*PAYLOADS, b"more"]


def test_open_append_on_corrupt_log_raises_and_leaves_file_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    damaged = bytearray(path.read_bytes())
    damaged[offsets[1] + PREFIX_SIZE] ^= 0x01
    damaged = damaged[:-3]
    path.write_bytes(bytes(damaged))

    with pytest.raises(CorruptLogError):
        EventLog.open_append(path)
    assert path.read_bytes() == bytes(damaged)


def test_open_append_on_missing_file_raises_log_open_error(tmp_path: Path) -> None:
    with pytest.raises(LogOpenError, match="No such file"):
        EventLog.open_append(tmp_path / "nope.kvlog")


# --------------------------------------------------------------------------- the writer's lock


def open_writer(path: Path, payloads: list[bytes]) -> EventLog:
    """A writer left open (holding the lock) with ``payloads`` appended and flushed."""
    log = EventLog.create(path, schema_version=3, kvsched_version="0.1.0", config=CONFIG)
    for payload in payloads:
        log.append(payload)
    log.flush()
    return log


def test_a_second_create_on_a_log_open_for_writing_raises_locked_and_leaves_the_file_intact(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.kvlog"
    with open_writer(path, PAYLOADS) as first:
        before = path.read_bytes()

        with pytest.raises(LogLockedError) as info:
            EventLog.create(path, schema_version=1, kvsched_version="0", config={})

        assert path.read_bytes() == before
        first.append(b"still-writing")
    assert str(info.value) == (
        f"cannot write event log {path}: another writer holds it (its exclusive lock is taken)"
    )
    assert isinstance(info.value, LogOpenError)
    assert info.value.path == str(path)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)
    assert read_log(path).records == [*PAYLOADS, b"still-writing"]


def test_open_append_on_a_log_open_for_writing_raises_locked_and_leaves_the_file_intact(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.kvlog"
    with open_writer(path, PAYLOADS) as first:
        before = path.read_bytes()

        with pytest.raises(LogLockedError, match="another writer holds it"):
            EventLog.open_append(path)

        assert path.read_bytes() == before
        first.append(b"still-writing")
    assert read_log(path).records == [*PAYLOADS, b"still-writing"]


def test_after_close_the_log_can_be_reopened_for_append_and_then_locks_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.kvlog"
    open_writer(path, PAYLOADS).close()

    with EventLog.open_append(path) as log:
        log.append(b"appended")
        with pytest.raises(LogLockedError):
            EventLog.open_append(path)
    with EventLog.open_append(path) as log:
        log.append(b"again")

    assert read_log(path).records == [*PAYLOADS, b"appended", b"again"]


def test_readers_do_not_lock_and_are_not_blocked_by_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    with open_writer(path, PAYLOADS):
        assert read_log(path).records == PAYLOADS
        assert [r.payload for r in iter_log(path)] == PAYLOADS


_SECOND_WRITER = """
import sys, time
from kvsched.events.log import EventLog, LogLockedError
start = time.monotonic()
try:
    EventLog.{call}
except LogLockedError as exc:
    print(f"locked in {{time.monotonic() - start:.3f}} s: {{exc}}")
    sys.exit(3)
sys.exit(0)
"""


@pytest.mark.parametrize(
    "call",
    [
        "create(sys.argv[1], schema_version=1, kvsched_version='0', config={})",
        "open_append(sys.argv[1])",
    ],
    ids=["create", "open_append"],
)
def test_a_second_writer_in_another_process_fails_at_once(tmp_path: Path, call: str) -> None:
    path = tmp_path / "run.kvlog"
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    with open_writer(path, PAYLOADS):
        before = path.read_bytes()
        done = subprocess.run(
            [sys.executable, "-c", _SECOND_WRITER.format(call=call), str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert path.read_bytes() == before

    assert done.returncode == 3, done.stderr
    assert f"cannot write event log {path}: another writer holds it" in done.stdout
    seconds = float(done.stdout.split()[2])
    assert seconds < 1.0  # non-blocking: it did not wait for the lock
    assert read_log(path).records == PAYLOADS


# --------------------------------------------------------------------------- performance


def test_ten_thousand_small_records_append_and_read_quickly(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    payload = bytes(range(200))
    best_write = best_read = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        with EventLog.create(path, schema_version=1, kvsched_version="0", config={}) as log:
            for _ in range(10_000):
                log.append(payload)
        best_write = min(best_write, time.perf_counter() - start)
        start = time.perf_counter()
        contents = read_log(path)
        best_read = min(best_read, time.perf_counter() - start)

    assert len(contents.records) == 10_000
    # Budget is 50 ms; allow headroom for slow shared CI machines.
    assert best_write < 0.25
    assert best_read < 0.25


# --------------------------------------------------------------------------- properties


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    payloads=st.lists(st.binary(max_size=64), max_size=12),
    cut_fraction=st.floats(min_value=0.0, max_value=1.0),
)
def test_any_payload_list_round_trips_and_any_cut_keeps_whole_records(
    tmp_path: Path, payloads: list[bytes], cut_fraction: float
) -> None:
    path = tmp_path / "prop.kvlog"
    offsets = write_log(path, payloads)
    data = path.read_bytes()
    first = header_end(path)

    full = read_log(path)
    assert full.records == payloads
    assert full.offsets == offsets

    cut = round(cut_fraction * len(data))
    path.write_bytes(data[:cut])
    if cut < first:
        with pytest.raises(CorruptLogError):
            read_log(path)
        return
    contents = read_log(path)
    ends = [o + PREFIX_SIZE + len(p) for o, p in zip(offsets, payloads, strict=True)]
    kept = [p for p, end in zip(payloads, ends, strict=True) if end <= cut]

    assert contents.records == kept
    assert contents.valid_size == max([first, *[e for e in ends if e <= cut]])
    assert (contents.torn_tail is None) == (cut == contents.valid_size)


# --------------------------------------------------------------------------- write failures


class _FullDisk(io.FileIO):
    """A file on a disk that fills up at ``limit`` bytes: a write reaching it is cut short,
    the next one fails with ENOSPC (as the kernel does)."""

    limit = 0

    def write(self, data: Any) -> int:
        room = self.limit - self.tell()
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(bytes(data)[:room])


def _reopen_on_full_disk(path: Path, limit: int) -> EventLog:
    """``path`` (a log) reopened for appending through a :class:`_FullDisk` of ``limit``."""
    contents = read_log(path)
    raw = _FullDisk(path, "r+b")
    raw.limit = limit
    raw.seek(contents.size)
    file = io.BufferedWriter(raw, buffer_size=1 << 16)
    return EventLog(path, file, contents.header, contents.size)


def test_a_full_disk_cuts_the_log_to_its_last_flushed_record_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "full.kvlog"
    write_log(path, [])
    start = path.stat().st_size
    log = _reopen_on_full_disk(path, start + 2 * (PREFIX_SIZE + 100) + 50)
    log.append(b"a" * 100)
    log.flush()
    log.append(b"b" * 100)
    log.flush()
    log.append(b"c" * 100)  # half of it fits
    with pytest.raises(LogWriteError) as info:
        log.flush()
    assert log.closed
    error = info.value
    assert (error.errno, error.steps, error.size) == (errno.ENOSPC, 2, start + 2 * 112)
    assert str(error) == (
        f"cannot write event log {path}: No space left on device; the log is closed and "
        f"verifiable up to its last complete step (2 steps, {start + 224} bytes)"
    )
    contents = read_log(path)
    assert contents.records == [b"a" * 100, b"b" * 100] and contents.torn_tail is None
    log.close()  # idempotent after the failure


def test_close_drops_a_record_that_an_interruption_cut_between_its_two_writes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "interrupted.kvlog"
    log = EventLog.create(path, schema_version=3, kvsched_version="0.1.0", config=CONFIG)
    log.append(b"complete")
    real, writes = log._file, []

    class Interrupting:  # the file: Ctrl-C arrives after the frame's prefix is written
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def write(self, data: bytes) -> int:
            writes.append(data)
            if len(writes) == 2:
                raise KeyboardInterrupt
            return real.write(data)

    log._file = Interrupting()  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        log.append(b"cut short")
    log.close()
    contents = read_log(path)
    assert contents.records == [b"complete"] and contents.torn_tail is None
    assert log.records == 1


def test_a_write_failing_after_open_append_counts_the_records_already_in_the_log(
    tmp_path: Path,
) -> None:
    path = tmp_path / "resumed.kvlog"
    write_log(path, [b"one", b"two"])
    size = path.stat().st_size
    log = EventLog.open_append(path)
    real = log._file

    class FullDisk:  # the file: the disk is full from here on
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    log._file = FullDisk()  # type: ignore[assignment]
    with pytest.raises(LogWriteError) as info:
        log.append(b"three")
    assert (info.value.steps, info.value.size) == (2, size)
    assert read_log(path).records == [b"one", b"two"]
