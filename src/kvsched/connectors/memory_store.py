"""``InProcessStore``: the default KV store, a thread-safe LRU dict with a byte capacity, and
fault injection for tests (``Faults``)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import attrs

from kvsched.connectors.errors import (
    InvalidRequest,
    StoreUnavailable,
    TransferFailed,
)

__all__ = ["Faults", "InProcessStore"]


@attrs.define
class Faults:
    """Failure injection (mutable; change it while a test runs).

    * ``fail_after_gets``: after this many more successful key reads, every read raises
      ``TransferFailed`` (with the batch's good leading values in ``partial``).
    * ``missing``: keys that read and probe as absent although stored.
    * ``fail_keys``: keys whose read raises ``TransferFailed``.
    * ``get_delay_s``: sleep per ``get_many`` call (a slow store).
    * ``unavailable``: every call raises ``StoreUnavailable``.
    """

    fail_after_gets: int | None = None
    missing: set[str] = attrs.field(factory=set)
    fail_keys: set[str] = attrs.field(factory=set)
    get_delay_s: float = 0.0
    unavailable: bool = False


class InProcessStore:
    """A ``KVStore`` in this process's memory. Evicts least recently used values beyond
    ``capacity_bytes``; first writer wins on a present key (as Mooncake)."""

    def __init__(self, capacity_bytes: int = 1 << 30, faults: Faults | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.faults = faults if faults is not None else Faults()
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self.gets = 0  # successful key reads, for tests
        self.evictions = 0

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._data)

    def _check(self) -> None:
        if self._closed:
            raise StoreUnavailable("store is closed")
        if self.faults.unavailable:
            raise StoreUnavailable("injected: store unavailable")

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self._check()
            missing = self.faults.missing
            return [k in self._data and k not in missing for k in keys]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        with self._lock:
            self._check()
            for key, value in items:
                if not value:
                    raise InvalidRequest(f"empty value for {key!r}", name="INVALID_PARAMS")
                if len(value) > self.capacity_bytes:
                    raise InvalidRequest(f"value of {len(value)} bytes exceeds the capacity")
            for key, value in items:
                if key in self._data:
                    self._data.move_to_end(key)
                    continue
                self._data[key] = bytes(value)
                self._bytes += len(value)
            while self._bytes > self.capacity_bytes:
                _, old = self._data.popitem(last=False)
                self._bytes -= len(old)
                self.evictions += 1

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        delay = self.faults.get_delay_s
        if delay:
            time.sleep(delay)
        with self._lock:
            self._check()
            f = self.faults
            out: list[bytes | None] = []
            for key in keys:
                exhausted = f.fail_after_gets is not None and f.fail_after_gets <= 0
                if key in f.fail_keys or exhausted:
                    good: list[bytes] = []
                    for v in out:
                        if v is None:
                            break
                        good.append(v)
                    raise TransferFailed(f"injected read failure at {key!r}", partial=good)
                value = None if key in f.missing else self._data.get(key)
                if value is not None:
                    self._data.move_to_end(key)
                    self.gets += 1
                    if f.fail_after_gets is not None:
                        f.fail_after_gets -= 1
                out.append(value)
            return out

    def remove(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._check()
            for key in keys:
                value = self._data.pop(key, None)
                if value is not None:
                    self._bytes -= len(value)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._data.clear()
            self._bytes = 0
