"""events/reader.py: reading an event log a frame at a time, or all of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsched.events.log import EventLog
from kvsched.events.reader import LogReader, iter_log, read_log


def written(tmp_path: Path, payloads: list[bytes]) -> Path:
    path = tmp_path / "run.kvlog"
    log = EventLog.create(path, schema_version=4, kvsched_version="0", config={})
    for p in payloads:
        log.append(p)
    log.close()
    return path


def test_every_record_comes_back_in_order_with_its_byte_offset(tmp_path: Path):
    path = written(tmp_path, [b"a", b"bb", b"ccc"])
    records = list(iter_log(path))
    assert [r.payload for r in records] == [b"a", b"bb", b"ccc"]
    assert records[0].offset < records[1].offset < records[2].offset
    assert read_log(path).records == [b"a", b"bb", b"ccc"]


def test_a_torn_last_frame_is_reported_after_the_complete_records(tmp_path: Path):
    path = written(tmp_path, [b"a" * 10, b"b" * 10])
    path.write_bytes(path.read_bytes()[:-3])
    contents = read_log(path)
    assert contents.records == [b"a" * 10] and contents.torn_tail is not None
    assert contents.valid_size < contents.size


def test_the_tail_of_a_log_is_unknown_until_the_reader_has_read_to_its_end(tmp_path: Path):
    reader = LogReader(written(tmp_path, [b"a"]))
    with pytest.raises(RuntimeError, match="not fully read"):
        _ = reader.torn_tail
    reader.read_all()
    assert reader.torn_tail is None and reader.padding == 0
