"""``MooncakeStore``: the ``KVStore`` protocol over a Mooncake Store (``mooncake.store``).

Topology (see ``docs/connectors.md``): a ``mooncake_master`` with P2PHANDSHAKE metadata, a
standalone ``mooncake_client`` memory holder, and this client with ``global_segment_size=0``
so the data lives in the holder and outlives the writer.

Every native call runs in a small thread pool and is waited for with a deadline
(``timeout_s``): a master that stops answering blocks a call for ~30 s inside Mooncake; here
the caller gets ``StoreTimeout`` after ``timeout_s``. While ``max_stuck`` calls are still
blocked, further calls fail at once with ``StoreUnavailable`` instead of queueing.

Mooncake returns ints and ``b''``, never raises; this adapter maps them:

* ``get_batch`` gives ``b''`` for a missing key *and* for a failed read. An empty entry is
  probed with ``batch_is_exist``: absent -> ``None`` (a miss); present -> ``TransferFailed``
  (the value's holder died; its keys vanish after the master's ``--client_ttl``); a negative
  code -> the typed error of that code.
* negative codes from ``put_batch``, ``batch_is_exist`` and ``batch_remove`` -> typed errors
  (``errors.mooncake_error``); ``OBJECT_NOT_FOUND`` on remove is not an error.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvsched.connectors.errors import (
    InvalidRequest,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    TransferFailed,
    mooncake_error,
)
from kvsched.connectors.mooncake_cluster import MooncakeUnavailable, mooncake_env

__all__ = ["MooncakeStore"]

T = TypeVar("T")
_OBJECT_NOT_FOUND = -704


def _import_store() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:  # package missing, or store.so cannot load libibverbs.so.1
        raise MooncakeUnavailable(
            f"cannot import mooncake.store ({exc}); install 'kvsched[mooncake]' and the "
            "libibverbs1 system package"
        ) from exc
    return MooncakeDistributedStore


class MooncakeStore:
    """A Mooncake Store client. ``master``: ``host:port`` of ``mooncake_master`` (default:
    ``$MOONCAKE_MASTER``). ``local_buffer_size`` must hold the largest ``get_many`` batch:
    batches are split to ``batch_keys`` keys and, for puts, to ``local_buffer_size`` bytes."""

    def __init__(
        self,
        master: str | None = None,
        *,
        metadata_server: str = "P2PHANDSHAKE",
        local_buffer_size: int = 64 << 20,
        global_segment_size: int = 0,
        timeout_s: float = 5.0,
        setup_timeout_s: float = 15.0,
        batch_keys: int = 32,
        max_stuck: int = 2,
    ) -> None:
        master = master or os.environ.get("MOONCAKE_MASTER")
        if not master:
            raise ValueError("no Mooncake master address (pass master= or set MOONCAKE_MASTER)")
        for key, value in mooncake_env({}).items():
            os.environ.setdefault(key, value)
        cls = _import_store()
        self.master = master
        self.timeout_s = timeout_s
        self.local_buffer_size = local_buffer_size
        self.batch_keys = batch_keys
        self.max_stuck = max_stuck
        self._pool = ThreadPoolExecutor(max_workers=max_stuck + 2, thread_name_prefix="mooncake")
        self._stuck = 0
        self._lock = threading.Lock()
        self._closed = False
        self._store = cls()
        rc = self._call(
            lambda: self._store.setup(
                "127.0.0.1",
                metadata_server,
                global_segment_size,
                local_buffer_size,
                "tcp",
                "",
                master,
            ),
            "setup",
            setup_timeout_s,
        )
        if rc != 0:
            self._pool.shutdown(wait=False)
            raise StoreUnavailable(f"setup against master {master} returned {rc}", code=rc)

    # ----------------------------------------------------------------------- plumbing

    def _call(self, fn: Callable[[], T], what: str, timeout_s: float | None = None) -> T:
        """Run a blocking native call in the pool; wait at most ``timeout_s``."""
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"{what}: store is closed")
            if self._stuck >= self.max_stuck:
                raise StoreUnavailable(
                    f"{what}: {self._stuck} earlier calls are still blocked in Mooncake"
                )
            self._stuck += 1
        future: Future[T] = self._pool.submit(fn)
        future.add_done_callback(self._release)
        try:
            return future.result(timeout=self.timeout_s if timeout_s is None else timeout_s)
        except FutureTimeout:
            raise StoreTimeout(
                f"{what} did not return within {timeout_s or self.timeout_s:.1f}s "
                f"(master {self.master})"
            ) from None

    def _release(self, _: Future[Any]) -> None:
        with self._lock:
            self._stuck -= 1

    # ----------------------------------------------------------------------- KVStore

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        for i in range(0, len(keys), 256):
            chunk = list(keys[i : i + 256])
            codes = self._exists_codes(chunk)
            for key, code in zip(chunk, codes, strict=True):
                if code < 0:
                    raise mooncake_error(code, f"batch_is_exist({key!r})")
                out.append(code == 1)
        return out

    def _exists_codes(self, keys: list[str]) -> list[int]:
        codes: list[int] = self._call(lambda: self._store.batch_is_exist(keys), "exists")
        return codes

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        batch: list[tuple[str, bytes]] = []
        size = 0
        for key, value in items:
            if not value:
                raise InvalidRequest(f"empty value for {key!r}", code=-600, name="INVALID_PARAMS")
            if len(value) > self.local_buffer_size:
                raise InvalidRequest(
                    f"value of {len(value)} bytes exceeds local_buffer_size "
                    f"{self.local_buffer_size}",
                    code=-600,
                    name="INVALID_PARAMS",
                )
            if batch and (size + len(value) > self.local_buffer_size or len(batch) >= 256):
                self._put_batch(batch)
                batch, size = [], 0
            batch.append((key, value))
            size += len(value)
        if batch:
            self._put_batch(batch)

    def _put_batch(self, batch: list[tuple[str, bytes]]) -> None:
        keys = [k for k, _ in batch]
        values = [v for _, v in batch]
        rc = self._call(lambda: self._store.put_batch(keys, values), "put_batch")
        if rc != 0:
            raise mooncake_error(int(rc), f"put_batch of {len(keys)} keys")

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for i in range(0, len(keys), self.batch_keys):
            chunk = list(keys[i : i + self.batch_keys])
            try:
                out.extend(self._get_chunk(chunk))
            except StoreError as exc:
                lead = _leading(out)
                partial = lead + list(exc.partial) if len(lead) == len(out) else lead
                exc.partial = tuple(partial)
                raise
        return out

    def _get_chunk(self, chunk: list[str]) -> list[bytes | None]:
        values: list[bytes] = self._call(lambda: self._store.get_batch(chunk), "get_batch")
        empty = [j for j, v in enumerate(values) if not v]
        codes: list[int] = []
        if empty:
            probe = [chunk[j] for j in empty]
            codes = self._exists_codes(probe)
        present = dict(zip(empty, codes, strict=True))
        out: list[bytes | None] = []
        for j, value in enumerate(values):
            if value:
                out.append(bytes(value))
                continue
            code = present[j]
            if code == 0:
                out.append(None)
                continue
            partial = list(_leading(out)) if None not in out else []
            if code == 1:
                raise TransferFailed(
                    f"{chunk[j]!r} exists but could not be read (its memory holder is gone?)",
                    code=-800,
                    name="TRANSFER_FAIL",
                    partial=partial,
                )
            raise mooncake_error(code, f"get {chunk[j]!r}", partial=partial)
        return out

    def remove(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 256):
            chunk = list(keys[i : i + 256])
            codes = self._remove_codes(chunk)
            for key, code in zip(chunk, codes, strict=True):
                if code < 0 and code != _OBJECT_NOT_FOUND:
                    raise mooncake_error(code, f"remove {key!r}")

    def _remove_codes(self, keys: list[str]) -> list[int]:
        codes: list[int] = self._call(lambda: self._store.batch_remove(keys, True), "remove")
        return codes

    def healthy(self) -> bool:
        """Mooncake's ``health_check() == 0`` (it does not notice every dead master)."""
        try:
            return int(self._call(self._store.health_check, "health_check")) == 0
        except StoreError:
            return False

    def close(self) -> None:
        """Close the client (about 1 s inside Mooncake), bounded by ``timeout_s``."""
        with self._lock:
            if self._closed:
                return
        try:
            self._call(self._store.close, "close")
        except StoreError:
            pass
        finally:
            with self._lock:
                self._closed = True
            self._pool.shutdown(wait=False)


def _leading(values: Sequence[bytes | None]) -> list[bytes]:
    out: list[bytes] = []
    for v in values:
        if v is None:
            break
        out.append(v)
    return out
