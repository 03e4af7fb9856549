"""The golden logs: recorded by the release that introduced the versioned wire schema
(version 2, ``tests/golden/record.py``) and committed. Every later kvsched must still read
and verify them with 0 divergences, or upcast them, or refuse them with an error that names
both schema versions; silently misreading them is the failure this test exists to catch."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsched.events.codec import OLDEST_READABLE, SCHEMA_VERSION, decode_record
from kvsched.events.log import read_log
from kvsched.replay.verify import LogError, verify_log
from kvsched.stream import CacheView

HERE = Path(__file__).resolve().parent
GOLDEN = sorted(HERE.glob("schema2-*.kvlog"))
GOLDEN_VERSION = 2

# Every event type of schema version 2, frozen here: the golden logs use all of them.
SCHEMA2_TYPES = {
    "RequestArrived", "RequestAborted", "SessionEnded", "DrainRequested", "WakeRequested",
    "StepExecuted", "StepFailed", "KVLookupAnswered", "KVLoadFinished", "KVLoadFailed",
    "KVSaveFinished", "StepStarted", "RequestRejected", "SequenceAdmitted", "PrefixMatched",
    "BlocksAllocated", "BlocksFreed", "BlocksCached", "BlocksEvicted", "CacheCleared",
    "SessionBlocksHeld", "PrefillScheduled", "DecodeScheduled", "SequencePreempted",
    "SequenceFinished", "SequenceAborted", "SessionClosed", "Drained", "Woken",
    "CheckpointReserved", "CheckpointPublished", "CheckpointPinned", "CheckpointUnpinned",
    "CheckpointAbandoned", "CheckpointReleased", "CheckpointEvicted", "KVLookupStarted",
    "KVLoadCancelled", "KVLoadAdmitted", "KVLoadStarted", "KVLoadSettled", "KVSaveStarted",
    "AbortDeferred", "DrainDeferred",
}  # fmt: skip


def test_the_golden_logs_exist_and_were_written_in_schema_version_2():
    assert [p.name for p in GOLDEN] == ["schema2-attention.kvlog", "schema2-hybrid.kvlog"]
    for path in GOLDEN:
        assert read_log(path).header["schema_version"] == GOLDEN_VERSION


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_a_golden_log_verifies_or_is_refused_naming_both_schema_versions(path: Path):
    if OLDEST_READABLE <= GOLDEN_VERSION <= SCHEMA_VERSION:
        result = verify_log(str(path))
        assert result.divergence is None, result.divergence.describe()
        assert result.steps == len(read_log(path).records) and result.torn_tail is None
    else:  # a later schema that neither reads nor upcasts version 2 must say so
        with pytest.raises(LogError) as info:
            verify_log(str(path))
        assert str(GOLDEN_VERSION) in str(info.value) and str(SCHEMA_VERSION) in str(info.value)


def test_the_golden_logs_together_use_every_event_type_of_schema_2():
    seen: set[str] = set()
    for path in GOLDEN:
        for payload in read_log(path).records:
            record = decode_record(payload)
            seen |= {type(e).__name__ for e in (*record.inputs, *record.decisions)}
    assert seen == SCHEMA2_TYPES


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_a_follower_can_rebuild_the_cache_from_a_golden_log(path: Path):
    view = CacheView()
    for payload in read_log(path).records:
        view.apply_record(decode_record(payload))
    summary = view.summary()
    assert summary["arrived"] > 20 and summary["blocks_cached"] > 0
