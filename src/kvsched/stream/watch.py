"""``kvsched watch``: follow a published event stream and summarise it live.

A run publishes with ``kvsched demo --publish ENDPOINT`` (or ``replay --publish``): each step's
record, in the versioned schema of the event log, over ZeroMQ (``events/wire.py``). The
watcher subscribes, checks the stream's schema version, folds every record into a
``CacheView`` and prints a line every ``every`` steps (admissions, prefix hits, cache use:
cached blocks, stored checkpoints and how many were evicted), then a final summary when the
stream ends.

A view is complete only if the watcher saw the stream from its first step without a gap; it
says so, and exits 1 otherwise (0 when complete, 2 when the stream cannot be read). Ctrl-C
and ``timeout_s`` without a message (the publisher died) end a watch like the stream's end:
``watch`` returns the view it rebuilt, with ``stopped`` saying why (its summary and ``--dump``
are still written; the view is incomplete, exit 1).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import msgspec

from kvsched.events.codec import RecordDecodeError, check_schema, decode_record
from kvsched.events.wire import Message, Subscriber, WireError, WireTimeout
from kvsched.stream.view import CacheView

__all__ = ["StreamError", "Watched", "WireError", "dump", "summary_line", "watch"]


class StreamError(ValueError):
    """A stream that cannot be followed: another schema, or records that do not decode."""


@attrs.define
class Watched:
    view: CacheView
    header: dict[str, Any] | None = None
    first_seq: int | None = None
    gaps: list[tuple[int, int]] = attrs.field(factory=list)
    ended: bool = False
    records: int = 0
    stopped: str | None = None  # why it stopped before the end: "interrupted", a timeout

    @property
    def complete(self) -> bool:
        """The view saw every step from the first: it equals the engine's cache."""
        return self.ended and self.first_seq == 0 and not self.gaps and self.header is not None

    def summary(self) -> dict[str, Any]:
        return {
            **self.view.summary(),
            "records": self.records,
            "first_seq": self.first_seq,
            "gaps": [list(g) for g in self.gaps],
            "ended": self.ended,
            "stopped": self.stopped,
            "complete": self.complete,
        }


def summary_line(s: dict[str, Any]) -> str:
    return (
        f"step {s['step']:>7,}  arrived {s['arrived']:>6,}  admitted {s['admitted']:>6,}  "
        f"hit {100 * s['token_hit_rate']:5.1f} %  cached {s['cached_blocks']:>7,} blocks  "
        f"checkpoints {s['checkpoints']:>5,} ({s['ckpts_evicted']:,} evicted)  "
        f"running {s['running']:>4}  "
        f"waiting {s['waiting']:>5}  finished {s['finished']:>6,}"
    )


def watch(
    endpoint: str,
    *,
    timeout_s: float | None = 30.0,
    every: int = 100,
    on_line: Callable[[str], None] = print,
) -> Watched:
    """Follow the stream at ``endpoint`` until it ends, nothing arrives for ``timeout_s``
    (``stopped``: the timeout) or Ctrl-C (``stopped``: "interrupted"); returns what was
    rebuilt in every case. Raises WireError (bad endpoint, malformed message) or StreamError
    (schema, undecodable record)."""
    watched = Watched(CacheView())
    with Subscriber(endpoint, timeout_s=timeout_s) as sub:
        try:
            for message in sub:
                _receive(watched, message, endpoint, every, on_line)
        except WireTimeout as exc:
            watched.stopped = str(exc)
        except KeyboardInterrupt:
            watched.stopped = "interrupted"
        watched.gaps = list(sub.gaps)
    return watched


def _receive(
    watched: Watched, message: Message, endpoint: str, every: int, on_line: Callable[[str], None]
) -> None:
    if watched.first_seq is None:
        watched.first_seq = message.seq
        watched.view.strict = message.seq == 0  # a late joiner skips what it missed
    if message.kind == "header":
        watched.header = _header(message.payload, endpoint)
    elif message.kind == "step":
        _apply(watched, message.payload, message.seq)
        if every and watched.view.step % every == 0:
            on_line(summary_line(watched.view.summary()))
    else:
        watched.ended = True


def _header(payload: bytes, endpoint: str) -> dict[str, Any]:
    try:
        header = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise StreamError(f"the stream at {endpoint} sent a header that is not msgpack") from exc
    if not isinstance(header, dict):
        raise StreamError(f"the stream at {endpoint} sent a header that is not a map")
    try:
        check_schema(header, f"the stream at {endpoint}")
    except ValueError as exc:
        raise StreamError(str(exc)) from exc
    return header


def _apply(watched: Watched, payload: bytes, seq: int) -> None:
    try:
        record = decode_record(payload)
    except RecordDecodeError as exc:
        raise StreamError(f"step message {seq}: {exc}") from exc
    watched.view.apply_record(record)
    watched.records += 1


def dump(watched: Watched, path: str) -> None:
    """Write the rebuilt view and the summary as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"summary": watched.summary(), "view": watched.view.snapshot()}, f)
