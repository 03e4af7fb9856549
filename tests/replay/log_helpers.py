"""Reading a recorded log's tokens, and writing edited copies of it (verify tests)."""

from __future__ import annotations

from collections.abc import Sequence

from kvsched.events import types as ev
from kvsched.events.codec import decode_record
from kvsched.events.log import EventLog, read_log


def sampled(path: str) -> dict[int, list[int]]:
    """Every request's sampled tokens, from the outcomes recorded in a log, in the order
    they were folded."""
    out: dict[int, list[int]] = {}
    for payload in read_log(path).records:
        for e in decode_record(payload).inputs:
            if isinstance(e, ev.StepExecuted):
                for seq_id, token in zip(e.seq_ids.tolist(), e.tokens.tolist(), strict=True):
                    out.setdefault(seq_id, []).append(token)
    return out


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
