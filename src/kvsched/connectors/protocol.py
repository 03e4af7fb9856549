"""The connector protocol: what the scheduler, the worker and a KV store say to each other.

The scheduler decides every transfer itself and records it as an event that carries its keys'
ingredients (``KVLookupStarted``, ``KVLoadStarted``, ``KVSaveStarted``); the orders below are
pure functions of those events. Two roles carry them out:

* scheduler side, ``SchedulerConnector``: ``lookup(LookupRequest) -> LookupResult | PENDING``
  (how many leading blocks of the asked range the store holds; ``PENDING``: ask again next
  step; repeatable until ``cancel_lookup``), ``cancel_lookup(seq_id)``, ``close()``. Never
  blocks the step loop.
* worker side, ``WorkerConnector``: ``apply(StepTransfers)`` starts loads and saves,
  ``poll() -> TransferReport`` collects the ones that ended (``report_events`` turns a report
  into the scheduler's input events), ``wait_idle``, ``num_active``, ``close``.

Byte level (``KVStore``): ``batch_exists``, ``put_many``, ``get_many``, ``remove``, ``close``.
Buffers (``BlockBuffer``, ``StateBuffer``): ``read_block``/``write_block`` and
``read_state``/``write_state``; the torch executor provides its own.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, TypeAlias, runtime_checkable

import attrs

from kvsched.connectors.keys import block_key, state_key
from kvsched.events.types import (
    Event,
    KVLoadFailed,
    KVLoadFinished,
    KVLoadStarted,
    KVLookupStarted,
    KVSaveFinished,
    KVSaveStarted,
    split_hashes,
)

__all__ = [
    "PENDING",
    "BlockBuffer",
    "KVStore",
    "LoadOrder",
    "LookupAnswer",
    "LookupRequest",
    "LookupResult",
    "Pending",
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
    ``first_block`` blocks the scheduler already has (so ``>= first_block``). The blocks to
    load are ``[first_block, num_blocks)``."""

    num_blocks: int
    reason: str = ""  # why the answer is shorter than it could be (store error, timeout)


LookupAnswer: TypeAlias = LookupResult | Literal[Pending.PENDING]


@attrs.frozen(kw_only=True)
class LookupRequest:
    """What a lookup needs, as plain data: the chain blocks ``[first_block, first_block +
    len(block_hashes))`` of a request (the scheduler has the blocks before ``first_block``)."""

    seq_id: int
    namespace_root: bytes
    block_hashes: tuple[bytes, ...]  # hashes of the asked blocks, from block ``first_block``
    first_block: int = 0
    with_state: bool = False  # hybrid: a hit must end at a block with a state checkpoint

    @classmethod
    def from_event(cls, e: KVLookupStarted) -> LookupRequest:
        return cls(
            seq_id=e.seq_id,
            namespace_root=e.root,
            block_hashes=tuple(split_hashes(e.hashes)),
            first_block=e.first_block,
            with_state=e.with_state,
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

    @classmethod
    def from_event(cls, e: KVLoadStarted) -> LoadOrder:
        """The load a ``KVLoadStarted`` decision orders."""
        return cls(
            seq_id=e.seq_id,
            keys=tuple(block_key(e.root, h) for h in split_hashes(e.hashes)),
            block_ids=tuple(int(b) for b in e.blocks),
            state_key=state_key(e.root, e.state_hash) if e.state_hash else None,
            state_slot=e.state_slot,
        )


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

    @classmethod
    def from_event(cls, e: KVSaveStarted) -> SaveOrder:
        """The save a ``KVSaveStarted`` decision orders (a hybrid save stores the state under
        the last saved block's hash)."""
        hashes = split_hashes(e.hashes)
        return cls(
            save_id=e.save_id,
            seq_id=e.seq_id,
            keys=tuple(block_key(e.root, h) for h in hashes),
            block_ids=tuple(int(b) for b in e.blocks),
            state_key=state_key(e.root, hashes[-1]) if e.ckpt_id >= 0 else None,
            state_slot=e.state_slot,
        )


@attrs.frozen
class StepTransfers:
    """The loads and saves the worker starts after a step."""

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
    """Scheduler side: answers lookups without blocking the step loop."""

    def lookup(self, request: LookupRequest) -> LookupAnswer: ...

    def cancel_lookup(self, seq_id: int) -> None: ...

    def close(self) -> None: ...


class WorkerConnector(Protocol):
    """Worker side: starts the orders of a step, reports the transfers that ended."""

    def apply(self, transfers: StepTransfers) -> None: ...

    def poll(self) -> TransferReport: ...

    def wait_idle(self, timeout_s: float = 10.0) -> bool: ...

    @property
    def num_active(self) -> int: ...

    def close(self) -> None: ...
