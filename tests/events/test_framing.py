"""How reading classifies the end of a log: torn tail, crash padding, or corruption; and that
the reader holds one frame at a time."""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from pathlib import Path

import pytest

from kvsched.events.framing import PREFIX_SIZE, _find_frame
from kvsched.events.log import CorruptLogError, EventLog, LogReader, read_log

PAYLOADS = [bytes([i]) * (40 + i) for i in range(1, 9)]


def write_log(path: Path, payloads: list[bytes]) -> list[int]:
    with EventLog.create(path, schema_version=4, kvsched_version="0", config={}) as log:
        return [log.append(p) for p in payloads]


def lying_prefix(length: int, payload: bytes) -> bytes:
    """A prefix whose own checksum is right but which claims ``length`` bytes."""
    head = struct.pack("<II", length, zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head))


def test_a_middle_frame_claiming_4_gib_with_frames_behind_it_is_corrupt_not_a_torn_tail(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    data = bytearray(path.read_bytes())
    at = offsets[3]
    data[at : at + PREFIX_SIZE] = lying_prefix(0xFFFF_FFF0, PAYLOADS[3])
    path.write_bytes(bytes(data))

    with pytest.raises(CorruptLogError) as info:
        read_log(path)

    assert info.value.offset == at
    assert info.value.reason == (
        f"frame claims {0xFFFF_FFF0} bytes, {at + PREFIX_SIZE + 0xFFFF_FFF0 - len(data)} past "
        f"the end of the file, but a complete frame follows at byte {offsets[4]}"
    )


def test_a_last_frame_claiming_more_than_the_file_holds_is_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    data = bytearray(path.read_bytes())
    data[offsets[-1] : offsets[-1] + PREFIX_SIZE] = lying_prefix(0xFFFF_FFF0, PAYLOADS[-1])
    path.write_bytes(bytes(data))

    contents = read_log(path)

    assert contents.records == PAYLOADS[:-1]
    assert contents.torn_tail is not None and contents.torn_tail.offset == offsets[-1]


@pytest.mark.parametrize("zeros", [PREFIX_SIZE, 4096, 70_000])
def test_intact_records_followed_by_zeros_are_complete_steps_then_crash_padding(
    tmp_path: Path, zeros: int
) -> None:
    path = tmp_path / "run.kvlog"
    write_log(path, PAYLOADS)
    end = path.stat().st_size
    with path.open("ab") as f:
        f.write(bytes(zeros))

    contents = read_log(path)

    assert contents.records == PAYLOADS
    assert (contents.torn_tail, contents.padding, contents.valid_size) == (None, zeros, end)


def test_a_last_frame_whose_unwritten_part_is_zeros_is_a_torn_tail_not_corruption(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    data = bytearray(path.read_bytes())
    cut = offsets[-1] + PREFIX_SIZE + 5  # the last payload reached the disk for 5 bytes
    data[cut:] = bytes(len(data) - cut + 4096)  # then zeros, past the frame's end
    path.write_bytes(bytes(data))

    contents = read_log(path)

    assert contents.records == PAYLOADS[:-1] and contents.padding == 0
    torn = contents.torn_tail
    assert torn is not None and torn.offset == offsets[-1]
    assert f"zero-filled from byte {cut} to the end of the file" in torn.reason


def test_a_zeroed_middle_frame_with_records_behind_it_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    offsets = write_log(path, PAYLOADS)
    data = bytearray(path.read_bytes())
    data[offsets[2] : offsets[3]] = bytes(offsets[3] - offsets[2])
    path.write_bytes(bytes(data))

    with pytest.raises(CorruptLogError, match="prefix checksum mismatch") as info:
        read_log(path)
    assert info.value.offset == offsets[2]


def test_fewer_zero_bytes_than_a_frame_prefix_are_a_torn_prefix(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    write_log(path, PAYLOADS)
    with path.open("ab") as f:
        f.write(bytes(PREFIX_SIZE - 1))

    contents = read_log(path)

    assert contents.padding == 0 and contents.torn_tail is not None
    assert "incomplete frame prefix" in contents.torn_tail.reason


def test_find_frame_finds_a_frame_at_any_alignment_and_nothing_in_noise(tmp_path: Path) -> None:
    noise = bytes((i * 7919 + 13) % 251 for i in range(3000))
    frame = lying_prefix(5, b"hello") + b"hello"
    for at in (0, 1, 2, 3, 1234):
        path = tmp_path / f"f{at}"
        path.write_bytes(noise[:at] + frame + noise)
        with path.open("rb") as f:
            assert _find_frame(f, 0, path.stat().st_size, path.stat().st_size) == at
    path.write_bytes(noise)
    with path.open("rb") as f:
        assert _find_frame(f, 0, len(noise), len(noise)) is None


def test_reading_a_log_holds_one_frame_at_a_time_not_the_file(tmp_path: Path) -> None:
    path = tmp_path / "big.kvlog"
    payload = bytes(range(256)) * 64  # 16 KiB
    write_log(path, [payload] * 1000)  # about 16 MiB
    size = path.stat().st_size

    tracemalloc.start()
    try:
        reader = LogReader(path)
        count = sum(1 for _ in reader)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert count == 1000 and reader.torn_tail is None
    assert peak < 2 * 1024 * 1024 and size > 8 * peak, peak  # the read buffer and a frame


def test_a_padded_log_is_recognised_without_reading_its_zeros_into_memory(tmp_path: Path) -> None:
    path = tmp_path / "padded.kvlog"
    write_log(path, PAYLOADS)
    with path.open("ab") as f:
        f.truncate(path.stat().st_size + 64 * 1024 * 1024)  # a sparse 64 MiB of zeros

    tracemalloc.start()
    try:
        reader = LogReader(path)
        records = [r.payload for r in reader]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert records == PAYLOADS and reader.padding == 64 * 1024 * 1024
    assert peak < 8 * 1024 * 1024, peak
