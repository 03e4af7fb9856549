"""Scheduler side: ``StoreConnector`` answers lookups from a ``KVStore``.

Nothing here blocks the step loop: a lookup probes the store on a background thread and
answers ``PENDING`` until the probe is back (or answers at once with ``synchronous=True``).
A probe that fails or outlives ``lookup_timeout_s`` answers "no external blocks" with the
reason in ``LookupResult.reason``. The answer is kept, and given again, until
``cancel_lookup``. Loads and saves need no connector state: their orders are built from the
scheduler's decisions (``LoadOrder.from_event``, ``SaveOrder.from_event``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import attrs

from kvsched.connectors.errors import StoreError
from kvsched.connectors.keys import block_key, state_key
from kvsched.connectors.protocol import (
    PENDING,
    KVStore,
    LookupAnswer,
    LookupRequest,
    LookupResult,
)

__all__ = ["StoreConnector", "count_available"]


def count_available(store: KVStore, request: LookupRequest) -> LookupResult:
    """``first_block`` plus the length of the available prefix of ``request.block_hashes``
    (blocking; one or two ``batch_exists`` probes). With ``with_state`` the prefix is cut
    back to the last block whose state checkpoint is stored."""
    start = request.first_block
    hashes = request.block_hashes
    if not hashes:
        return LookupResult(start)
    root = request.namespace_root
    try:
        present = store.batch_exists([block_key(root, h) for h in hashes])
        n = 0
        while n < len(present) and present[n]:
            n += 1
        if request.with_state and n:
            states = store.batch_exists([state_key(root, h) for h in hashes[:n]])
            while n and not states[n - 1]:
                n -= 1
    except StoreError as exc:
        return LookupResult(start, reason=f"lookup failed: {exc}")
    return LookupResult(start + n)


@attrs.define
class _Lookup:
    request: LookupRequest
    future: Future[LookupResult] | None
    started: float
    result: LookupResult | None = None


class StoreConnector:
    """The scheduler-side connector over one ``KVStore``."""

    def __init__(
        self, store: KVStore, *, synchronous: bool = False, lookup_timeout_s: float = 5.0
    ) -> None:
        self.store = store
        self.synchronous = synchronous
        self.lookup_timeout_s = lookup_timeout_s
        self._pool = None if synchronous else ThreadPoolExecutor(1, thread_name_prefix="kvlookup")
        self._lookups: dict[int, _Lookup] = {}

    # ------------------------------------------------------------------- lookups

    def lookup(self, request: LookupRequest) -> LookupAnswer:
        seq = request.seq_id
        entry = self._lookups.get(seq)
        if entry is None:
            if self._pool is None:
                entry = _Lookup(request, None, 0.0, count_available(self.store, request))
            else:
                future = self._pool.submit(count_available, self.store, request)
                entry = _Lookup(request, future, time.monotonic())
            self._lookups[seq] = entry
        if entry.result is None:
            assert entry.future is not None
            if entry.future.done():
                entry.result = entry.future.result()
            elif time.monotonic() - entry.started > self.lookup_timeout_s:
                entry.result = LookupResult(
                    request.first_block,
                    reason=f"lookup timed out after {self.lookup_timeout_s:.1f}s",
                )
            else:
                return PENDING
        return entry.result

    def cancel_lookup(self, seq_id: int) -> None:
        """Forget a lookup (abort, or the scheduler decided not to load)."""
        entry = self._lookups.pop(seq_id, None)
        if entry is not None and entry.future is not None:
            entry.future.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
