"""Scheduler side: ``StoreConnector`` answers lookups from a ``KVStore`` and turns each step's
``ConnectorInput`` into the loads and saves the worker starts.

Nothing here blocks the step loop: a lookup probes the store on a background thread and
answers ``PENDING`` until the probe is back (or answers at once with ``synchronous=True``).
A probe that fails or outlives ``lookup_timeout_s`` answers "no external blocks" with the
reason in ``LookupResult.reason``.

Per sequence the connector keeps: the lookup answer until ``bind`` / ``cancel_lookup``, the
bound load until ``build_step`` orders it, a save cursor (blocks ``[0, cursor)`` have been
ordered saved), and the ids of its saves in flight. ``request_finished`` says whether its
blocks must outlive it; ``update`` returns the ids whose last save has since ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import attrs

from kvsched.connectors.errors import StoreError
from kvsched.connectors.keys import block_key, state_key
from kvsched.connectors.protocol import (
    PENDING,
    ConnectorInput,
    KVStore,
    LoadOrder,
    LookupAnswer,
    LookupRequest,
    LookupResult,
    SaveOrder,
    StepTransfers,
    TransferReport,
)

__all__ = ["StoreConnector", "count_available"]


def count_available(store: KVStore, request: LookupRequest) -> LookupResult:
    """Length of the available prefix of ``request.block_hashes`` (blocking; one or two
    ``batch_exists`` probes). With ``with_state`` the prefix is cut back to the last block
    whose state checkpoint is stored."""
    start = request.num_computed_blocks
    hashes = request.block_hashes[start:]
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
    """The scheduler-side connector over one ``KVStore``.

    ``save_enabled``: order saves of computed full blocks (the default). ``first_save_id``:
    save ids are allocated increasingly from it (deterministic for replay).
    """

    def __init__(
        self,
        store: KVStore,
        *,
        synchronous: bool = False,
        lookup_timeout_s: float = 5.0,
        save_enabled: bool = True,
        first_save_id: int = 0,
    ) -> None:
        self.store = store
        self.synchronous = synchronous
        self.lookup_timeout_s = lookup_timeout_s
        self.save_enabled = save_enabled
        self._pool = None if synchronous else ThreadPoolExecutor(1, thread_name_prefix="kvlookup")
        self._lock = threading.Lock()
        self._lookups: dict[int, _Lookup] = {}
        self._bound: dict[int, LoadOrder] = {}
        self._loading: set[int] = set()
        self._cursor: dict[int, int] = {}
        self._saves: dict[int, set[int]] = {}  # seq_id -> save ids in flight
        self._save_seq: dict[int, int] = {}  # save_id -> seq_id
        self._finished: set[int] = set()  # finished seqs waiting for their saves
        self._next_save_id = first_save_id

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
                    request.num_computed_blocks,
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

    def bind(self, seq_id: int, block_ids: Sequence[int], first_block: int | None = None) -> None:
        """The destination blocks of chain blocks ``[first_block, first_block + n)`` (default
        ``first_block``: the lookup's ``num_computed_blocks``; fewer ids: load only that many
        blocks). Consumes the lookup answer. With ``with_state`` the state at the end of the
        range is loaded too (a range of no blocks then loads only the state)."""
        entry = self._lookups.get(seq_id)
        if entry is None or entry.result is None:
            raise ValueError(f"bind({seq_id}): no answered lookup for this sequence")
        req, res = entry.request, entry.result
        first = req.num_computed_blocks if first_block is None else first_block
        if first < req.num_computed_blocks or first + len(block_ids) > res.num_blocks:
            raise ValueError(
                f"bind({seq_id}): blocks [{first}, {first + len(block_ids)}) outside the"
                f" available [{req.num_computed_blocks}, {res.num_blocks})"
            )
        del self._lookups[seq_id]
        end = first + len(block_ids)
        if not block_ids and not (req.with_state and end):
            return
        hashes = req.block_hashes[first:end]
        keys = tuple(block_key(req.namespace_root, h) for h in hashes)
        state = state_key(req.namespace_root, req.block_hashes[end - 1]) if req.with_state else None
        self._bound[seq_id] = LoadOrder(
            seq_id=seq_id, keys=keys, block_ids=tuple(int(b) for b in block_ids), state_key=state
        )

    def take_loads(self) -> tuple[LoadOrder, ...]:
        """The loads bound since the previous call (the worker starts them now)."""
        loads = tuple(self._bound[s] for s in sorted(self._bound))
        self._loading.update(self._bound)
        self._bound.clear()
        return loads

    def set_state_slot(self, seq_id: int, slot: int) -> None:
        """Hybrid models: the state slot a bound load restores its checkpoint into."""
        order = self._bound[seq_id]
        self._bound[seq_id] = attrs.evolve(order, state_slot=slot)

    # --------------------------------------------------------------------- steps

    def build_step(self, step_input: ConnectorInput) -> StepTransfers:
        loads = self.take_loads()
        saves: list[SaveOrder] = []
        if self.save_enabled:
            inp = step_input
            offsets = inp.offsets
            for i, seq in enumerate(int(s) for s in inp.seq_ids):
                if inp.save is not None and not inp.save[i]:
                    continue
                full = min(int(inp.token_ends[i]) // inp.block_size, len(inp.block_hashes[i]))
                full = min(full, int(inp.block_counts[i]))
                lo = self._cursor.get(seq, 0)
                if full <= lo:
                    continue
                root = inp.namespace_roots[i]
                blocks = inp.block_ids[offsets[i] + lo : offsets[i] + full]
                keys = tuple(block_key(root, h) for h in inp.block_hashes[i][lo:full])
                save_id = self._next_save_id
                self._next_save_id += 1
                saves.append(
                    SaveOrder(
                        save_id=save_id,
                        seq_id=seq,
                        keys=keys,
                        block_ids=tuple(int(b) for b in blocks),
                    )
                )
                self._cursor[seq] = full
                self._saves.setdefault(seq, set()).add(save_id)
                self._save_seq[save_id] = seq
        return StepTransfers(loads, tuple(saves))

    def update(self, report: TransferReport) -> list[int]:
        """Fold a worker report. Returns the finished sequences whose saves are now all done
        (their blocks may be freed), sorted."""
        self._loading.difference_update(report.finished_loads)
        self._loading.difference_update(report.failed_loads)
        released: list[int] = []
        for save_id in (*report.finished_saves, *report.failed_saves):
            seq = self._save_seq.pop(save_id, None)
            if seq is None:
                continue
            pending = self._saves.get(seq)
            if pending is not None:
                pending.discard(save_id)
                if not pending:
                    del self._saves[seq]
                    if seq in self._finished:
                        self._finished.discard(seq)
                        released.append(seq)
        return sorted(released)

    def request_finished(self, seq_id: int) -> bool:
        """The sequence ended (finished, aborted or preempted). True: saves of its blocks are
        in flight; keep the blocks until ``update`` returns ``seq_id``."""
        self.cancel_lookup(seq_id)
        self._bound.pop(seq_id, None)
        self._cursor.pop(seq_id, None)
        if self._saves.get(seq_id):
            self._finished.add(seq_id)
            return True
        return False

    def has_unfinished(self) -> bool:
        """Loads or saves in flight (poll the worker before draining)."""
        return bool(self._loading or self._saves or self._bound)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
