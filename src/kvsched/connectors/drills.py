"""Fault drills: a ``KVStore`` that fails on cue, to rehearse what a serving engine does when
its store goes wrong (``DrillStore``; ``KvschedConnector``'s ``drill`` option in vLLM).

A drill wraps the worker's store client (the scheduler's lookups see the healthy store, so a
drill fault lands between a lookup and its load, as a real one does). It counts the values
the worker read (``get``) or wrote (``put``) and, once ``after`` of them have passed, acts:

* ``evict``: every key read from then on is removed first (a key evicted between the lookup
  that found it and the load that reads it; the reads before it make a partial load);
* ``kill``: every call from then on raises ``StoreUnavailable`` (the store stopped);
* ``freeze``: every call from then on blocks for ``freeze_s`` seconds (a store that hangs;
  the transfer's own deadline must end it), then proceeds.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs

from kvsched.connectors.errors import StoreUnavailable
from kvsched.connectors.protocol import KVStore

__all__ = ["Drill", "DrillStore"]

MODES = ("evict", "kill", "freeze")


@attrs.frozen(kw_only=True)
class Drill:
    mode: str
    on: str = "get"  # "get" (loads) or "put" (saves)
    after: int = 0  # values read (or written) before the fault
    freeze_s: float = 30.0

    def __attrs_post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"drill mode must be one of {MODES}, got {self.mode!r}")
        if self.on not in ("get", "put"):
            raise ValueError(f"drill 'on' must be 'get' or 'put', got {self.on!r}")
        if self.after < 0 or self.freeze_s < 0:
            raise ValueError("drill 'after' and 'freeze_s' must be >= 0")

    @classmethod
    def parse(cls, spec: Any) -> Drill:
        if not isinstance(spec, dict):
            raise ValueError(f"a drill is a dict (mode, on, after, freeze_s), got {spec!r}")
        return cls(**spec)


class DrillStore:
    """``inner`` with ``drill``'s fault once its count has passed (thread-safe)."""

    def __init__(self, inner: KVStore, drill: Drill) -> None:
        self.inner = inner
        self.drill = drill
        self._count = 0
        self._lock = threading.Lock()

    @property
    def triggered(self) -> bool:
        return self._count >= self.drill.after

    def _fault(self, kind: str, n: int) -> bool:
        """Count ``n`` values of ``kind``; whether the fault acts on this call."""
        with self._lock:
            if kind != self.drill.on or self.triggered:
                return self.triggered
            self._count += n
            return False

    def _act(self, partial: Sequence[bytes] = ()) -> None:
        """The fault (``partial``: the values a batch read already had, which a killed
        store's client hands back with its error, as ``MooncakeStore`` does)."""
        if self.drill.mode == "kill":
            raise StoreUnavailable("drill: the store was killed", partial=partial)
        if self.drill.mode == "freeze":
            time.sleep(self.drill.freeze_s)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if self.triggered and self.drill.mode != "evict":
            self._act()
        return self.inner.batch_exists(keys)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        if self._fault("put", len(items)) and self.drill.mode != "evict":
            self._act()
        self.inner.put_many(items)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:  # (one at a time: the fault may start inside a batch)
            if self._fault("get", 1):
                if self.drill.mode == "evict":
                    self.inner.remove([key])
                else:
                    self._act(list(itertools.takewhile(lambda v: v is not None, out)))  # type: ignore[arg-type]
            out += self.inner.get_many([key])
        return out

    def remove(self, keys: Sequence[str]) -> None:
        self.inner.remove(keys)

    def close(self) -> None:
        self.inner.close()
