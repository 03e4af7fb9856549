"""Writing edited copies of a recorded log (verify tests)."""

from __future__ import annotations

from collections.abc import Sequence

from kvsched.events.log import EventLog, read_log


def write_log(src: str, dst: str, payloads: Sequence[bytes]) -> list[int]:
    """A log with ``src``'s header and these record payloads; returns their byte offsets."""
    header = read_log(src).header
    with EventLog.create(
        dst,
        schema_version=header["schema_version"],
        kvsched_version=header["kvsched_version"],
        config=header["config"],
    ) as log:
        return [log.append(p) for p in payloads]
