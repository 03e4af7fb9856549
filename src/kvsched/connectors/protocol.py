"""The connector protocol: what the scheduler, the worker and a KV store say to each other.

Scheduler side (``SchedulerConnector``), called from the step loop, never blocking:

* ``lookup(request) -> LookupResult | PENDING``: how many leading blocks of the request's
  hash chain are available (local ones plus external ones). ``PENDING``: not known yet, ask
  again next step. Repeatable: once answered, the same answer until ``bind`` or
  ``cancel_lookup``.
* ``bind(seq_id, block_ids)``: after admission, the destination blocks of the external part
  ``[num_computed_blocks, num_blocks)``; the load is ordered in the next ``build_step``.
* ``build_step(ConnectorInput) -> StepTransfers``: once per step, from plan data; returns the
  loads and saves the worker must start.
* ``update(TransferReport) -> list[seq_id]``: fold the worker's report; returns the sequences
  whose delayed block release may now happen.
* ``request_finished(seq_id) -> bool``: True: saves of this sequence are in flight, keep its
  blocks until ``update`` returns its id.

Worker side (``WorkerConnector``): ``start_load``, ``start_save``, ``poll() -> TransferReport``.

Byte level (``KVStore``): ``batch_exists``, ``put_many``, ``get_many``, ``remove``, ``close``.
Buffers (``BlockBuffer``, ``StateBuffer``): ``read_block``/``write_block`` and
``read_state``/``write_state``; the torch executor provides its own.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, Protocol, TypeAlias, runtime_checkable

import attrs
import numpy as np

from kvsched.events.types import Event, KVLoadFailed, KVLoadFinished, KVSaveFinished

__all__ = [
    "PENDING",
    "BlockBuffer",
    "ConnectorInput",
    "KVStore",
    "LoadOrder",
    "LookupAnswer",
    "LookupRequest",
    "LookupResult",
    "Pending",
    "PlanLike",
    "SaveOrder",
    "SchedulerConnector",
    "StateBuffer",
    "StepTransfers",
    "TransferReport",
    "WorkerConnector",
    "report_events",
]


# ------------------------------------------------------------------------- store level


@runtime_checkable
class KVStore(Protocol):
    """A byte-level key-value store of immutable, content-addressed values.

    Semantics every implementation keeps: values are non-empty; a put of a present key keeps
    the first value (first writer wins); a missing key reads as ``None``; the store may evict
    anything at any time (it is a cache); errors are ``errors.StoreError`` subclasses, and no
    call blocks longer than the store's own timeout.
    """

    def batch_exists(self, keys: Sequence[str]) -> list[bool]: ...

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None: ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def remove(self, keys: Sequence[str]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class BlockBuffer(Protocol):
    """Paged KV memory of a worker, seen block by block (a host array, GPU pages...)."""

    @property
    def block_bytes(self) -> int: ...

    def read_block(self, block_id: int) -> bytes: ...

    def write_block(self, block_id: int, data: bytes) -> None: ...


@runtime_checkable
class StateBuffer(Protocol):
    """State slots of a hybrid model: conv and recurrent state bytes per slot."""

    def read_state(self, slot: int) -> tuple[bytes, bytes]: ...

    def write_state(self, slot: int, conv: bytes, recurrent: bytes) -> None: ...


# ----------------------------------------------------------------------- scheduler side


class Pending(enum.Enum):
    """The lookup is not answered yet: ask again next step."""

    PENDING = "pending"


PENDING: Literal[Pending.PENDING] = Pending.PENDING


@attrs.frozen
class LookupResult:
    """``num_blocks``: length of the available prefix of the request's chain, counting the
    ``num_computed_blocks`` the scheduler already has (so ``>= num_computed_blocks``). The
    blocks to load are ``[num_computed_blocks, num_blocks)``."""

    num_blocks: int
    reason: str = ""  # why the answer is shorter than it could be (store error, timeout)


LookupAnswer: TypeAlias = LookupResult | Literal[Pending.PENDING]


@attrs.frozen(kw_only=True)
class LookupRequest:
    """What a lookup needs, as plain data (not the scheduler's sequence object)."""

    seq_id: int
    namespace_root: bytes
    block_hashes: tuple[bytes, ...]  # the request's full-block chain, from block 0
    num_computed_blocks: int = 0  # leading blocks the scheduler has already (local hit)
    with_state: bool = False  # hybrid: a hit must end at a block with a state checkpoint


class PlanLike(Protocol):
    """The ``StepPlan`` fields ``ConnectorInput.from_plan`` reads."""

    @property
    def step(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def seq_ids(self) -> np.ndarray: ...

    @property
    def ends(self) -> np.ndarray: ...

    @property
    def block_tables(self) -> np.ndarray: ...

    @property
    def num_blocks(self) -> np.ndarray: ...


def _ro(arr: np.ndarray, dtype: type) -> np.ndarray:
    out: np.ndarray = np.array(arr, dtype=dtype, copy=True)
    out.setflags(write=False)
    return out


def _ro_i64(arr: np.ndarray) -> np.ndarray:
    return _ro(arr, np.int64)


def _ro_i32(arr: np.ndarray) -> np.ndarray:
    return _ro(arr, np.int32)


@attrs.frozen(kw_only=True)
class ConnectorInput:
    """One step's view for the connector, built from plan data.

    Per running sequence ``i``: ``token_ends[i]`` tokens have KV once this step's forward ran;
    its block table is ``block_ids[offsets[i]:offsets[i+1]]`` (CSR with ``block_counts``);
    ``block_hashes[i]`` are the hashes of its full blocks known so far (prompt blocks from
    arrival, output blocks once filled); ``namespace_roots[i]`` its namespace. Blocks
    ``[0, min(token_ends // block_size, len(block_hashes)))`` are saveable.
    """

    step: int
    block_size: int
    seq_ids: np.ndarray = attrs.field(converter=_ro_i64)
    token_ends: np.ndarray = attrs.field(converter=_ro_i64)
    block_counts: np.ndarray = attrs.field(converter=_ro_i32)
    block_ids: np.ndarray = attrs.field(converter=_ro_i32)
    block_hashes: tuple[tuple[bytes, ...], ...]
    namespace_roots: tuple[bytes, ...]
    save: np.ndarray | None = None  # bool [n]: which sequences save (None: all)

    def __attrs_post_init__(self) -> None:
        n = len(self.seq_ids)
        if not (len(self.token_ends) == len(self.block_counts) == n):
            raise ValueError("seq_ids, token_ends and block_counts must have one entry per seq")
        if len(self.block_hashes) != n or len(self.namespace_roots) != n:
            raise ValueError("block_hashes and namespace_roots must have one entry per seq")
        if int(self.block_counts.sum()) != len(self.block_ids):
            raise ValueError("block_ids length must equal block_counts.sum()")

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.block_counts, dtype=np.int64)))

    def blocks_of(self, i: int) -> np.ndarray:
        off = self.offsets
        return self.block_ids[off[i] : off[i + 1]]

    @classmethod
    def from_plan(
        cls,
        plan: PlanLike,
        hashes: Mapping[int, Sequence[bytes]],
        roots: Mapping[int, bytes],
        save: Iterable[int] | None = None,
    ) -> ConnectorInput:
        """Build from a ``StepPlan``: ``hashes[seq_id]`` and ``roots[seq_id]`` come from the
        sequence table (plain bytes); ``save`` limits saving to those seq ids."""
        seq_ids = np.asarray(plan.seq_ids, dtype=np.int64)
        counts = np.asarray(plan.num_blocks, dtype=np.int32)
        tables = np.asarray(plan.block_tables)
        flat = (
            np.concatenate([tables[i, : counts[i]] for i in range(len(seq_ids))])
            if len(seq_ids)
            else np.zeros(0, np.int32)
        )
        ids = [int(s) for s in seq_ids]
        save_mask = None
        if save is not None:
            chosen = set(save)
            save_mask = np.array([s in chosen for s in ids], dtype=bool)
        return cls(
            step=int(plan.step),
            block_size=int(plan.block_size),
            seq_ids=seq_ids,
            token_ends=np.asarray(plan.ends),
            block_counts=counts,
            block_ids=flat,
            block_hashes=tuple(tuple(hashes[s]) for s in ids),
            namespace_roots=tuple(roots[s] for s in ids),
            save=save_mask,
        )


@attrs.frozen(kw_only=True)
class LoadOrder:
    """Load ``keys[j]`` into block ``block_ids[j]``; then, if set, the state checkpoint
    ``state_key`` into state slot ``state_slot``."""

    seq_id: int
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]
    state_key: str | None = None
    state_slot: int = -1


@attrs.frozen(kw_only=True)
class SaveOrder:
    """Save block ``block_ids[j]`` under ``keys[j]`` (and, if set, state slot ``state_slot``
    under ``state_key``). The blocks must stay unchanged until the save is reported."""

    save_id: int
    seq_id: int
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]
    state_key: str | None = None
    state_slot: int = -1


@attrs.frozen
class StepTransfers:
    """What ``build_step`` asks the worker to start this step."""

    loads: tuple[LoadOrder, ...] = ()
    saves: tuple[SaveOrder, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves


@attrs.frozen
class TransferReport:
    """Transfers that ended since the previous ``poll``.

    ``failed_loads[seq_id] = (num_good_blocks, reason)``: the first ``num_good_blocks`` blocks
    of the load were written completely and may be used; the rest must not.
    """

    finished_loads: frozenset[int] = frozenset()
    failed_loads: Mapping[int, tuple[int, str]] = attrs.field(factory=dict)
    finished_saves: frozenset[int] = frozenset()
    failed_saves: Mapping[int, str] = attrs.field(factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_loads or self.failed_loads or self.finished_saves or self.failed_saves
        )


def report_events(report: TransferReport) -> list[Event]:
    """The report as scheduler input events, in a deterministic order (sorted ids)."""
    out: list[Event] = [KVLoadFinished(seq_id=s) for s in sorted(report.finished_loads)]
    out += [
        KVLoadFailed(
            seq_id=s, num_good_blocks=report.failed_loads[s][0], reason=report.failed_loads[s][1]
        )
        for s in sorted(report.failed_loads)
    ]
    out += [KVSaveFinished(save_id=s, ok=True) for s in sorted(report.finished_saves)]
    out += [KVSaveFinished(save_id=s, ok=False) for s in sorted(report.failed_saves)]
    return out


class SchedulerConnector(Protocol):
    def lookup(self, request: LookupRequest) -> LookupAnswer: ...

    def cancel_lookup(self, seq_id: int) -> None: ...

    def bind(self, seq_id: int, block_ids: Sequence[int]) -> None: ...

    def build_step(self, step_input: ConnectorInput) -> StepTransfers: ...

    def update(self, report: TransferReport) -> list[int]: ...

    def request_finished(self, seq_id: int) -> bool: ...


class WorkerConnector(Protocol):
    def start_load(
        self,
        seq_id: int,
        keys: Sequence[str],
        block_ids: Sequence[int],
        state: tuple[str, int] | None = None,
    ) -> None: ...

    def start_save(
        self,
        save_id: int,
        keys: Sequence[str],
        block_ids: Sequence[int],
        state: tuple[str, int] | None = None,
    ) -> None: ...

    def poll(self) -> TransferReport: ...
