"""Worker side: ``TransferEngine`` moves bytes between a ``KVStore`` and block / state buffers.

Each ``start_load`` / ``start_save`` becomes one job on a small thread pool; ``poll`` returns
the jobs that ended since the previous poll as a ``TransferReport``. Nothing here blocks the
caller: ``start_*`` only enqueue, and ``poll`` only collects.

Loads read their keys in batches of ``batch_blocks`` and write each block as soon as its batch
arrived, in order, stopping at the first missing, unreadable or wrongly sized block; the
report's ``num_good_blocks`` is the number of leading blocks written. A load with a state
checkpoint restores the state after all its blocks; if that fails the load fails with 0 good
blocks (without the state, a hybrid model cannot use any of them).

Saves read their blocks from the buffer (the scheduler keeps them pinned until the save is
reported), skip keys the store already has, and put the rest.

Deadlines: a job still running ``job_timeout_s`` after it started is reported failed by
``poll`` and cancelled: under the job's lock it can no longer write a block or read one, so
a late answer from a stuck store never lands in blocks the scheduler has reused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import attrs

from kvsched.connectors.buffers import decode_state, encode_state
from kvsched.connectors.errors import CorruptValueError, StoreError
from kvsched.connectors.protocol import (
    BlockBuffer,
    KVStore,
    StateBuffer,
    StepTransfers,
    TransferReport,
)

__all__ = ["TransferEngine"]


class _Cancelled(Exception):
    pass


@attrs.define(eq=False)
class _Job:
    kind: str  # "load" | "save"
    ident: int
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]
    state: tuple[str, int] | None
    started: float
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    cancelled: bool = False
    done: bool = False
    good: int = 0  # load: leading blocks written
    error: str = ""


class TransferEngine:
    """Moves KV blocks between ``store`` and ``blocks`` (and states to ``states``)."""

    def __init__(
        self,
        store: KVStore,
        blocks: BlockBuffer,
        states: StateBuffer | None = None,
        *,
        max_workers: int = 2,
        batch_blocks: int = 16,
        job_timeout_s: float = 10.0,
    ) -> None:
        self.store = store
        self.blocks = blocks
        self.states = states
        self.batch_blocks = batch_blocks
        self.job_timeout_s = job_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvxfer")
        self._lock = threading.Lock()
        self._active: dict[tuple[str, int], _Job] = {}
        self._ended: list[_Job] = []

    # --------------------------------------------------------------------- WorkerConnector

    def start_load(
        self,
        seq_id: int,
        keys: Sequence[str],
        block_ids: Sequence[int],
        state: tuple[str, int] | None = None,
    ) -> None:
        self._start("load", seq_id, keys, block_ids, state)

    def start_save(
        self,
        save_id: int,
        keys: Sequence[str],
        block_ids: Sequence[int],
        state: tuple[str, int] | None = None,
    ) -> None:
        self._start("save", save_id, keys, block_ids, state)

    def apply(self, transfers: StepTransfers) -> None:
        """Start every load and save of a ``StepTransfers``."""
        for load in transfers.loads:
            state = (load.state_key, load.state_slot) if load.state_key is not None else None
            self.start_load(load.seq_id, load.keys, load.block_ids, state)
        for save in transfers.saves:
            state = (save.state_key, save.state_slot) if save.state_key is not None else None
            self.start_save(save.save_id, save.keys, save.block_ids, state)

    def poll(self) -> TransferReport:
        now = time.monotonic()
        with self._lock:
            for key, job in list(self._active.items()):
                if now - job.started > self.job_timeout_s:
                    with job.lock:
                        if not job.done:
                            job.cancelled = True
                            job.done = True
                            job.error = f"timed out after {self.job_timeout_s:.1f}s"
                            self._ended.append(job)
                    del self._active[key]
            ended, self._ended = self._ended, []
        finished_loads, finished_saves = set(), set()
        failed_loads: dict[int, tuple[int, str]] = {}
        failed_saves: dict[int, str] = {}
        for job in ended:
            if job.kind == "load":
                if job.error:
                    failed_loads[job.ident] = (job.good, job.error)
                else:
                    finished_loads.add(job.ident)
            elif job.error:
                failed_saves[job.ident] = job.error
            else:
                finished_saves.add(job.ident)
        return TransferReport(
            frozenset(finished_loads), failed_loads, frozenset(finished_saves), failed_saves
        )

    # ----------------------------------------------------------------------- helpers

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Block until no job is active (tests and shutdown). False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.num_active:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self) -> None:
        """Stop accepting jobs; running jobs are abandoned (not waited for)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------ jobs

    def _start(
        self,
        kind: str,
        ident: int,
        keys: Sequence[str],
        block_ids: Sequence[int],
        state: tuple[str, int] | None,
    ) -> None:
        if len(keys) != len(block_ids):
            raise ValueError(f"{kind} {ident}: {len(keys)} keys for {len(block_ids)} blocks")
        if state is not None and self.states is None:
            raise ValueError(f"{kind} {ident}: a state transfer needs a StateBuffer")
        job = _Job(
            kind, ident, tuple(keys), tuple(int(b) for b in block_ids), state, time.monotonic()
        )
        with self._lock:
            if (kind, ident) in self._active:
                raise ValueError(f"{kind} {ident} is already in flight")
            self._active[(kind, ident)] = job
        run = self._run_load if kind == "load" else self._run_save
        self._pool.submit(self._guard, job, run)

    def _guard(self, job: _Job, run: object) -> None:
        assert callable(run)
        try:
            run(job)
        except _Cancelled:
            return
        except StoreError as exc:
            job.error = job.error or str(exc)
        except CorruptValueError as exc:
            job.error = job.error or f"corrupt value: {exc}"
        except Exception as exc:  # a bug or an executor error: report, never lose the job
            job.error = job.error or f"{type(exc).__name__}: {exc}"
        with self._lock, job.lock:
            if job.done:  # timed out meanwhile: already reported
                return
            job.done = True
            self._active.pop((job.kind, job.ident), None)
            self._ended.append(job)

    def _write(self, job: _Job, block_id: int, data: bytes) -> None:
        with job.lock:
            if job.cancelled:
                raise _Cancelled
            self.blocks.write_block(block_id, data)
            job.good += 1

    def _run_load(self, job: _Job) -> None:
        n = len(job.keys)
        for lo in range(0, n, self.batch_blocks):
            keys = job.keys[lo : lo + self.batch_blocks]
            try:
                values = self.store.get_many(keys)
            except StoreError as exc:
                for j, got in enumerate(exc.partial):
                    self._write(job, job.block_ids[lo + j], got)
                raise
            for j, value in enumerate(values):
                if value is None:
                    job.error = f"block {lo + j} missing from the store ({keys[j]})"
                    return
                self._write(job, job.block_ids[lo + j], value)
        if job.state is not None:
            key, slot = job.state
            try:
                (stored,) = self.store.get_many([key])
                if stored is None:
                    raise CorruptValueError(f"state checkpoint missing ({key})")
                conv, recurrent = decode_state(stored)
            except (StoreError, CorruptValueError) as exc:
                job.good = 0
                job.error = f"state checkpoint not restored: {exc}"
                return
            assert self.states is not None
            with job.lock:
                if job.cancelled:
                    raise _Cancelled
                self.states.write_state(slot, conv, recurrent)

    def _run_save(self, job: _Job) -> None:
        with job.lock:
            if job.cancelled:
                raise _Cancelled
            items = [
                (k, self.blocks.read_block(b)) for k, b in zip(job.keys, job.block_ids, strict=True)
            ]
            if job.state is not None:
                assert self.states is not None
                key, slot = job.state
                items.append((key, encode_state(*self.states.read_state(slot))))
        if not items:
            return
        present = self.store.batch_exists([k for k, _ in items])
        todo = [item for item, have in zip(items, present, strict=True) if not have]
        if todo:
            self.store.put_many(todo)
