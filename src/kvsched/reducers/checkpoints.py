"""CheckpointTable: recurrent-state slots and state checkpoints of hybrid models.

State pool rows (``config.num_state_slots``): row 0 is the null slot; rows 1..max_batch are the
runtime slots (batch row r owns slot 1 + r); the rest are checkpoint slots, each free or owned
by exactly one checkpoint or by one external load without a batch row (the state it loads is
written there, ``KVLoadStarted.state_slot``, and restored into the row's runtime slot when
the load is settled into a row, ``KVLoadSettled``; such a slot costs one aligned checkpoint).

A checkpoint is the recurrent state after ``step`` tokens of a prefix, saved from a runtime
slot after a forward. Its identity is the hash chain: for a block-aligned step, the hash of the
last full block; otherwise a digest of that hash and the partial tail's tokens. A published
checkpoint holds one KV reference on every block of its prefix path (and owns a frozen copy of
the partial tail block when the step is not aligned), so its prefix cannot be evicted under
it, and a sequence that restores it attaches the whole prefix by pinning the checkpoint: one
operation, however long the prefix. Lifecycle (``statemachines.CHECKPOINT``): RESERVED ->
PUBLISHED <-> PINNED; RESERVED -> RELEASED (abandoned); PUBLISHED -> EVICTED | RELEASED. A
pinned checkpoint is never evicted or released.

A checkpoint saved "before" a step (the end of a sequence that finished in the step just
executed) takes its path references at reservation: its producer releases its blocks at once.

Accounting: every checkpoint uses ``cost`` of the table's ``capacity`` (one per checkpoint, or
bytes: the state plus a frozen block's KV); the policy evicts before it reserves, so ``used``
never exceeds the capacity. The table chooses no victim: it offers the unpinned published
checkpoints least recently used first (``evictable``) and the facts the policy's eviction
strategies (``policy/eviction.py``) read: for "value", each checkpoint's hits (restores by
sequences), its placement rule, the aging ``floor`` at its last touch, and the table's floor
(raised to each evicted checkpoint's priority).

The table folds the checkpoint events, and the pins a save lease takes (``KVSaveStarted`` /
``KVSaveFinished``). It reads the block pool for a published checkpoint's prefix path, and
returns the references it takes or drops as a ``RefChange``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np

from kvsched.events import types as ev
from kvsched.identity import partial_key, tail_extra
from kvsched.reducers.blocks import BlockPool
from kvsched.reducers.ckpt_columns import CheckpointColumns, ColumnsView, Record
from kvsched.reducers.ckpt_saves import SaveQueue
from kvsched.reducers.errors import RefChange, ReplayMismatch
from kvsched.statemachines import CHECKPOINT, CkptState, fire

__all__ = ["Checkpoint", "CheckpointTable", "partial_key", "tail_extra"]

_EMPTY = np.zeros(0, dtype=np.int32)
PHASES = ("after", "within", "before")
BEFORE = "before"
_LAST_PIN, _MORE_PINS = frozenset(["last_pin"]), frozenset(["more_pins"])


@attrs.define(slots=True, eq=False)
class Checkpoint:
    ckpt_id: int
    seq_id: int  # the producer
    slot: int
    step: int
    key: bytes
    anchor: bytes  # hash of the last full block (the namespace root when step < block size)
    frozen_block: int  # 0 when the step is block-aligned
    state: CkptState = CkptState.RESERVED
    path: np.ndarray = attrs.field(factory=lambda: _EMPTY)  # prefix blocks (held refs)
    pins: int = 0
    stamp: int = 0  # LRU: last publish / unpin
    kind: str = ""  # the placement rule that chose it
    phase: str = "after"  # when its step saved it (CheckpointReserved.phase)
    cost: int = 1  # what it uses of the table's capacity
    hits: int = 0  # restores by sequences
    floor: float = 0.0  # the table's aging floor at its last touch (eviction "value")

    @property
    def holds_path(self) -> bool:
        """Whether it holds references on its prefix path (published, or saved before)."""
        return bool(len(self.path)) and (self.state != CkptState.RESERVED or self.phase == BEFORE)


def _row(c: Checkpoint) -> tuple[Record, bool]:
    """A checkpoint's row of the columns (``CheckpointColumns.write``): record, evictable."""
    record = (c.ckpt_id, c.seq_id, c.step, c.cost, c.hits, c.floor, c.stamp, c.kind)
    return record, c.state == CkptState.PUBLISHED


class CheckpointTable:
    def __init__(
        self,
        max_batch: int,
        budget: int,
        block_size: int,
        pool: BlockPool,
        capacity: int | None = None,
        costs: tuple[int, int] = (1, 1),
    ) -> None:
        """``budget`` checkpoint slots; ``capacity`` (default: the budget) what checkpoints
        may use together; ``costs``: what an aligned and a frozen-tail checkpoint use."""
        self.block_size = block_size
        self._pool = pool
        self.first_ckpt_slot = 1 + max_batch
        self.num_slots = 1 + max_batch + budget
        self.capacity = budget if capacity is None else capacity
        self.costs = costs
        self.used = 0
        self.floor = 0.0  # aging floor of the "value" eviction
        self.floor_mark = 0.0  # the highest floor folded so far (the floor never goes down)
        self.by_producer: dict[int, list[int]] = {}  # seq id -> its live checkpoints
        self.saves_by_kind: dict[str, int] = {}  # checkpoints reserved, per placement rule
        self.reused_by_kind: dict[str, int] = {}  # of those, restored at least once
        self.free_slots: list[int] = list(range(self.num_slots - 1, self.first_ckpt_slot - 1, -1))
        self.ckpts: dict[int, Checkpoint] = {}
        self.index: dict[bytes, int] = {}  # identity -> published (or pinned) checkpoint
        # anchor -> {tail length: published partial checkpoints of that length}; several can
        # share an anchor and a length (different tail tokens): the index tells them apart.
        self.partials: dict[bytes, dict[int, int]] = {}
        self.lru: deque[tuple[int, int]] = deque()  # (stamp, ckpt id), lazily cleaned
        self.clock = 0
        self.next_id = 1
        self.saves = 0
        self.restores = 0
        self.evictions = 0
        self._saves = SaveQueue()  # reserved, not yet published: by the step that saves them
        self.save_pins: dict[int, int] = {}  # save id -> the checkpoint its lease pins
        self.load_slots: dict[int, int] = {}  # seq id -> the slot its rowless load writes
        self.columns = CheckpointColumns(self.num_slots)  # the records by slot (ckpt_columns)

    def folds(self) -> dict[type[ev.Event], Callable[[Any], RefChange | None]]:
        return {
            ev.StepStarted: self._on_step_started,
            ev.CheckpointReserved: self._on_reserved,
            ev.CheckpointPublished: self._on_published,
            ev.CheckpointAbandoned: self._on_dropped,
            ev.CheckpointReleased: self._on_dropped,
            ev.CheckpointEvicted: self._on_dropped,
            ev.CheckpointPinned: self._on_pinned,
            ev.CheckpointUnpinned: self._on_unpinned,
            ev.KVSaveStarted: self._on_save_started,
            ev.KVSaveFinished: self._on_save_finished,
            ev.KVLoadStarted: self._on_load_started,
            ev.KVLoadSettled: self._on_load_settled,
            ev.SequencePreempted: self._on_load_dropped,
            ev.SequenceAborted: self._on_load_dropped,
        }

    # ------------------------------------------------------------------------ queries

    @staticmethod
    def runtime_slot(row: int) -> int:
        return 1 + row

    @staticmethod
    def runtime_slots(rows: np.ndarray) -> np.ndarray:
        return (rows + 1).astype(np.int32)

    def get(self, ckpt_id: int) -> Checkpoint:
        try:
            return self.ckpts[ckpt_id]
        except KeyError:
            raise ReplayMismatch(f"checkpoint {ckpt_id} does not exist") from None

    def dropped_blocks(self, c: Checkpoint) -> tuple[np.ndarray, ...]:
        """The references a checkpoint holds (its path, its frozen block)."""
        out: list[np.ndarray] = []
        if c.holds_path:
            out.append(c.path)
        if c.frozen_block:
            out.append(np.asarray([c.frozen_block], dtype=np.int32))
        return tuple(out)

    def find(self, key: bytes) -> Checkpoint | None:
        ckpt_id = self.index.get(key)
        return None if ckpt_id is None else self.ckpts[ckpt_id]

    def reserved_now(self, key: bytes) -> bool:
        """Whether the step being scheduled already reserved a save of this identity."""
        return key in self._saves.reserved_keys

    def find_partials(self, anchor: bytes) -> dict[int, int]:
        """{tail length: count} of published partial checkpoints after ``anchor``."""
        return self.partials.get(anchor, {})

    def _evictable(self, stamp: int, ckpt_id: int) -> bool:
        c = self.ckpts.get(ckpt_id)
        return c is not None and c.state == CkptState.PUBLISHED and c.stamp == stamp

    def evictable(self) -> list[Checkpoint]:
        """Unpinned published checkpoints, least recently used first: the candidates the
        policy's eviction strategy (``policy/eviction.py``) orders."""
        return [self.ckpts[i] for s, i in self.lru if self._evictable(s, i)]

    def value_columns(self) -> ColumnsView:
        """The records as read-only numpy columns by slot (``ckpt_columns``), valid until the
        next fold: what eviction ``value`` orders in one vectorised pass."""
        return self.columns.view()

    def checkpoints(self) -> Iterable[Checkpoint]:
        """Every live checkpoint (reserved, published or pinned), oldest first (a view)."""
        return self.ckpts.values()

    def awaiting_ids(self, step: int | None = None) -> list[int]:
        """The checkpoints that launched ``step`` saves (None: every launched step), to
        publish once its outcome lands (a copy)."""
        return self._saves.awaiting_ids(step)

    def in_flight(self) -> list[tuple[int, bytes]]:
        """(tokens, identity) of each checkpoint a launched step saves (published once its
        outcome lands)."""
        return [(self.ckpts[i].step, self.ckpts[i].key) for i in self._saves.awaiting_ids()]

    @property
    def reserving(self) -> bool:
        """Whether the step being scheduled reserved a save (its outcome is owed)."""
        return bool(self._saves.reserved)

    def saves_by_rule(self) -> Mapping[str, int]:
        """Checkpoints ever saved, by placement rule (a read-only view)."""
        return MappingProxyType(self.saves_by_kind)

    def restores_by_rule(self) -> Mapping[str, int]:
        """Checkpoints ever restored, by placement rule (a read-only view)."""
        return MappingProxyType(self.reused_by_kind)

    def peek_slot(self) -> int:
        return self.free_slots[-1] if self.free_slots else 0

    def load_slot_of(self, seq_id: int) -> int:
        """The slot a load without a row writes its state to (-1: none)."""
        return self.load_slots.get(seq_id, -1)

    def cost_of(self, frozen: bool) -> int:
        return self.costs[1] if frozen else self.costs[0]

    def room(self) -> int:
        """Capacity left."""
        return self.capacity - self.used

    def produced_by(self, seq_id: int) -> list[Checkpoint]:
        """The live checkpoints ``seq_id`` saved, oldest first."""
        return [self.ckpts[i] for i in self.by_producer.get(seq_id, ())]

    # -------------------------------------------------------------------------- folds

    def _fire(self, c: Checkpoint, e: ev.Event, facts: frozenset[str] = frozenset()) -> None:
        c.state = fire(CHECKPOINT, e, c.ckpt_id, c.state, facts)

    def _on_step_started(self, e: ev.StepStarted) -> None:
        self._saves.start(e.step)

    def _on_reserved(self, e: ev.CheckpointReserved) -> RefChange | None:
        if e.ckpt_id != self.next_id or not self.free_slots or self.free_slots[-1] != e.slot:
            raise ReplayMismatch(f"checkpoint {e.ckpt_id}: not the next id or slot")
        if bool(e.frozen_block) != bool(e.num_tokens % self.block_size):
            raise ReplayMismatch(f"checkpoint {e.ckpt_id}: frozen block and alignment disagree")
        if e.phase not in PHASES or (e.phase == "within" and e.frozen_block):
            raise ReplayMismatch(f"checkpoint {e.ckpt_id}: phase {e.phase!r} is not a phase")
        cost = self.cost_of(bool(e.frozen_block))
        if cost > self.room():
            raise ReplayMismatch(f"checkpoint {e.ckpt_id}: over the checkpoint capacity")
        path = self._prefix_path(e.ckpt_id, e.num_tokens, e.anchor) if e.phase == BEFORE else None
        self.free_slots.pop()
        self.next_id += 1
        c = Checkpoint(
            e.ckpt_id, e.seq_id, e.slot, e.num_tokens, e.key, e.anchor, e.frozen_block,
            kind=e.kind, phase=e.phase, cost=cost, floor=self.floor,
        )
        self.ckpts[c.ckpt_id] = c
        self._sync(c)
        self.by_producer.setdefault(c.seq_id, []).append(c.ckpt_id)
        self.used += cost
        self._saves.reserve(c.ckpt_id, c.key)
        self.saves += 1
        self.saves_by_kind[c.kind] = self.saves_by_kind.get(c.kind, 0) + 1
        if path is None:
            return None
        c.path = path  # the producer releases its blocks now: hold the path from here on
        return RefChange(attach=(path,))

    def _prefix_path(self, ckpt_id: int, step: int, anchor: bytes) -> np.ndarray:
        """The cached blocks of a checkpoint's prefix (ReplayMismatch if not all cached)."""
        depth = step // self.block_size
        anchor_block = self._pool.index.get(anchor) if depth else None
        if depth and anchor_block is None:
            raise ReplayMismatch(f"checkpoint {ckpt_id}: its prefix is not cached")
        path = self._pool.path_to(anchor_block) if anchor_block is not None else _EMPTY
        if len(path) != depth:
            raise ReplayMismatch(f"checkpoint {ckpt_id}: its prefix path has another depth")
        return path

    def _on_published(self, e: ev.CheckpointPublished) -> RefChange:
        c = self.get(e.ckpt_id)
        if not self._saves.launched(c.ckpt_id) or c.key in self.index:
            raise ReplayMismatch(f"checkpoint {c.ckpt_id} cannot be published")
        self._saves.remove(c.ckpt_id, c.key)
        held = c.phase == BEFORE
        path = c.path if held else self._prefix_path(c.ckpt_id, c.step, c.anchor)
        self._fire(c, e)
        c.path = path
        self.index[c.key] = c.ckpt_id
        if c.frozen_block:
            tails = self.partials.setdefault(c.anchor, {})
            tails[c.step] = tails.get(c.step, 0) + 1
        self._touch(c)
        return RefChange() if held else RefChange(attach=(path,))

    def _on_dropped(
        self, e: ev.CheckpointAbandoned | ev.CheckpointReleased | ev.CheckpointEvicted
    ) -> RefChange:
        """Abandon, release or evict: the slot returns to the free stack, the references go."""
        c = self.get(e.ckpt_id)
        dropped = self.dropped_blocks(c)
        self._fire(c, e)  # (abandon, release or evict: the event's type names it)
        if self.index.get(c.key) == c.ckpt_id:
            del self.index[c.key]
            if c.frozen_block:
                tails = self.partials[c.anchor]
                tails[c.step] -= 1
                if not tails[c.step]:
                    del tails[c.step]
                if not tails:
                    del self.partials[c.anchor]
        del self.ckpts[c.ckpt_id]
        self.columns.clear(c.slot)
        self.used -= c.cost
        produced = self.by_producer[c.seq_id]
        produced.remove(c.ckpt_id)
        if not produced:
            del self.by_producer[c.seq_id]
        self.free_slots.append(c.slot)
        self._saves.remove(c.ckpt_id, c.key)
        if isinstance(e, ev.CheckpointEvicted):
            self.evictions += 1
            if e.priority is not None:
                self.floor = max(self.floor, e.priority)
            self.floor_mark = max(self.floor_mark, self.floor)
        return RefChange(release=dropped)

    def _pin(self, c: Checkpoint, e: ev.Event) -> None:
        self._fire(c, e)
        c.pins += 1
        self.restores += 1
        self._sync(c)

    def _unpin(self, c: Checkpoint, e: ev.Event) -> None:
        self._fire(c, e, _LAST_PIN if c.pins == 1 else _MORE_PINS)
        c.pins -= 1
        if c.pins == 0:
            self._touch(c)

    def _on_pinned(self, e: ev.CheckpointPinned) -> None:
        c = self.get(e.ckpt_id)
        self._pin(c, e)
        if not c.hits:
            self.reused_by_kind[c.kind] = self.reused_by_kind.get(c.kind, 0) + 1
        c.hits += 1
        self._sync(c)

    def _on_unpinned(self, e: ev.CheckpointUnpinned) -> None:
        self._unpin(self.get(e.ckpt_id), e)

    def _on_save_started(self, e: ev.KVSaveStarted) -> None:
        if e.ckpt_id >= 0:
            self._pin(self.get(e.ckpt_id), e)
            self.save_pins[e.save_id] = e.ckpt_id

    def _on_save_finished(self, e: ev.KVSaveFinished) -> None:
        ckpt_id = self.save_pins.pop(e.save_id, None)
        if ckpt_id is not None:
            self._unpin(self.get(ckpt_id), e)

    def _on_load_started(self, e: ev.KVLoadStarted) -> None:
        """A load without a row takes the next free checkpoint slot for the state it loads
        (a load into a row's runtime slot, before schema 4, takes nothing)."""
        if e.state_slot < self.first_ckpt_slot:
            return
        cost = self.cost_of(False)
        if e.seq_id in self.load_slots or self.peek_slot() != e.state_slot or cost > self.room():
            raise ReplayMismatch(f"load of {e.seq_id}: state slot {e.state_slot} is not free")
        self.free_slots.pop()
        self.used += cost
        self.load_slots[e.seq_id] = e.state_slot

    def _on_load_settled(self, e: ev.KVLoadSettled) -> None:
        """The loaded state is restored from its slot into the row (StepWork plans the copy);
        the slot is free again."""
        if e.state_slot != self.load_slots.get(e.seq_id, -1):
            raise ReplayMismatch(f"load of {e.seq_id}: settled from state slot {e.state_slot}")
        self._on_load_dropped(e)

    def _on_load_dropped(
        self, e: ev.KVLoadSettled | ev.SequencePreempted | ev.SequenceAborted
    ) -> None:
        slot = self.load_slots.pop(e.seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            self.used -= self.cost_of(False)

    def _sync(self, c: Checkpoint) -> None:
        """Write ``c``'s record into the columns (after every fold that changes it)."""
        self.columns.write(c.slot, *_row(c))

    def _touch(self, c: Checkpoint) -> None:
        self.clock += 1
        c.stamp = self.clock
        c.floor = self.floor
        self._sync(c)
        self.lru.append((c.stamp, c.ckpt_id))
        if len(self.lru) > 4 * (len(self.ckpts) + 16):
            self.lru = deque((s, i) for s, i in self.lru if self._evictable(s, i))

    # --------------------------------------------------------------------- invariants

    def holders(self) -> list[np.ndarray]:
        """KV references held by checkpoints: published paths and frozen blocks."""
        out: list[np.ndarray] = []
        for c in self.ckpts.values():
            out.extend(self.dropped_blocks(c))
        return out

    def check_invariants(self, pins_by_ckpt: dict[int, int]) -> str | None:
        """``pins_by_ckpt``: the sequences pinning each checkpoint (the table adds the pins
        of save leases itself). None when consistent, else the first violation."""
        pins_by_ckpt = dict(pins_by_ckpt)
        for ckpt_id in self.save_pins.values():
            pins_by_ckpt[ckpt_id] = pins_by_ckpt.get(ckpt_id, 0) + 1
        owned = [c.slot for c in self.ckpts.values()] + list(self.load_slots.values())
        every = sorted(owned + self.free_slots)
        if every != list(range(self.first_ckpt_slot, self.num_slots)):
            return "checkpoint slots are not partitioned into free and owned (one owner each)"
        for c in self.ckpts.values():
            users = pins_by_ckpt.get(c.ckpt_id, 0)
            if c.pins != users:
                return f"checkpoint {c.ckpt_id}: {c.pins} pins but {users} users"
            if (c.state == CkptState.PINNED) != (c.pins > 0):
                return f"checkpoint {c.ckpt_id}: state {c.state.name} with {c.pins} pins"
            indexed = self.index.get(c.key) == c.ckpt_id
            if indexed != (c.state != CkptState.RESERVED):
                return f"checkpoint {c.ckpt_id}: indexed {indexed} in state {c.state.name}"
        loads = len(self.load_slots) * self.cost_of(False)
        if self.used != sum(c.cost for c in self.ckpts.values()) + loads or (
            self.used > self.capacity
        ):
            return f"checkpoints use {self.used} of {self.capacity}, not the sum of their costs"
        producers = sorted(i for ids in self.by_producer.values() for i in ids)
        if producers != sorted(self.ckpts) or any(
            self.ckpts[i].seq_id != seq_id for seq_id, ids in self.by_producer.items() for i in ids
        ):
            return "the producer index does not list every checkpoint under its producer"
        for key, ckpt_id in self.index.items():
            if ckpt_id not in self.ckpts or self.ckpts[ckpt_id].key != key:
                return f"index entry for checkpoint {ckpt_id} is stale"
        unknown = set(pins_by_ckpt) - set(self.ckpts)
        if unknown:
            return f"sequences pin unknown checkpoints {sorted(unknown)}"
        reserved = {i: c.key for i, c in self.ckpts.items() if c.state == CkptState.RESERVED}
        queue_problem = self._saves.problem(reserved)
        if queue_problem is not None:
            return queue_problem
        wrong = self.columns.mismatch({c.slot: _row(c) for c in self.ckpts.values()})
        if wrong is not None:
            return wrong
        if self.floor < self.floor_mark:
            return f"the aging floor went down to {self.floor} from {self.floor_mark}"
        return None

    def snapshot(self) -> tuple[object, ...]:
        return (
            tuple(
                (
                    c.ckpt_id, c.seq_id, c.slot, c.step, c.key, c.state, c.path.tobytes(),
                    c.pins, c.kind, c.phase, c.cost, c.hits, c.floor, c.stamp,
                )
                for c in self.ckpts.values()
            ),
            self.used,
            self.floor,
            tuple(sorted(self.saves_by_kind.items())),
            tuple(sorted(self.reused_by_kind.items())),
            tuple(self.free_slots),
            tuple(sorted(self.index.items())),
            self.next_id,
            self._saves.snapshot(),
            tuple(sorted(self.save_pins.items())),
            self.clock,
            tuple(sorted(self.load_slots.items())),
        )
