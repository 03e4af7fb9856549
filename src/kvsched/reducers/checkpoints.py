"""CheckpointTable: recurrent-state slots and state checkpoints of hybrid models.

State pool rows (``config.num_state_slots``): row 0 is the null slot; rows 1..max_batch are the
runtime slots (batch row r owns slot 1 + r); the rest are checkpoint slots, each free or owned
by exactly one checkpoint.

A checkpoint is the recurrent state after ``step`` tokens of a prefix, saved from a runtime
slot after a forward. Its identity is the hash chain: for a block-aligned step, the hash of the
last full block; otherwise a digest of that hash and the partial tail's tokens. A published
checkpoint holds one KV reference on every block of its prefix path (and owns a frozen copy of
the partial tail block when the step is not aligned), so its prefix cannot be evicted under
it, and a sequence that restores it attaches the whole prefix by pinning the checkpoint: one
operation, however long the prefix. Lifecycle (``statemachines.CHECKPOINT``): RESERVED ->
PUBLISHED <-> PINNED; RESERVED -> RELEASED (abandoned); PUBLISHED -> EVICTED | RELEASED. A
pinned checkpoint is never evicted or released.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from hashlib import blake2b
from typing import cast

import attrs
import numpy as np

from kvsched.events.types import MultimodalSpan
from kvsched.identity import DIGEST_SIZE
from kvsched.statemachines import CHECKPOINT, CkptEvent, CkptState

_EMPTY = np.zeros(0, dtype=np.int32)


def partial_key(anchor: bytes, tail: np.ndarray, extra: bytes = b"") -> bytes:
    """Identity of a non-aligned checkpoint: the anchor block's hash, the tail tokens and the
    content hashes of the multimodal spans overlapping the tail (``tail_extra``)."""
    h = blake2b(anchor, digest_size=DIGEST_SIZE, person=b"kvs-partial")
    h.update(np.ascontiguousarray(tail, dtype="<i4").tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def tail_extra(spans: Sequence[MultimodalSpan], start: int, end: int) -> bytes:
    """Content hashes of the spans overlapping tokens [start, end), as full blocks hash them."""
    return b"".join(s.content_hash for s in spans if s.start < end and start < s.end)


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
    path: np.ndarray = attrs.field(factory=lambda: _EMPTY)  # prefix blocks (published only)
    pins: int = 0
    stamp: int = 0  # LRU: last publish / unpin


class CheckpointTable:
    def __init__(self, max_batch: int, budget: int) -> None:
        self.first_ckpt_slot = 1 + max_batch
        self.num_slots = 1 + max_batch + budget
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

    # ------------------------------------------------------------------------ queries

    @staticmethod
    def runtime_slot(row: int) -> int:
        return 1 + row

    @staticmethod
    def runtime_slots(rows: np.ndarray) -> np.ndarray:
        return (rows + 1).astype(np.int32)

    def get(self, ckpt_id: int) -> Checkpoint:
        return self.ckpts[ckpt_id]

    def find(self, key: bytes) -> Checkpoint | None:
        ckpt_id = self.index.get(key)
        return None if ckpt_id is None else self.ckpts[ckpt_id]

    def find_partials(self, anchor: bytes) -> dict[int, int]:
        """{tail length: count} of published partial checkpoints after ``anchor``."""
        return self.partials.get(anchor, {})

    def _evictable(self, stamp: int, ckpt_id: int) -> bool:
        c = self.ckpts.get(ckpt_id)
        return c is not None and c.state == CkptState.PUBLISHED and c.stamp == stamp

    def eviction_order(self) -> list[Checkpoint]:
        """Unpinned published checkpoints, those with a frozen block first, then LRU."""
        live = [self.ckpts[i] for s, i in self.lru if self._evictable(s, i)]
        return sorted(live, key=lambda c: (c.frozen_block == 0, c.stamp))

    def peek_slot(self) -> int:
        return self.free_slots[-1] if self.free_slots else 0

    # ----------------------------------------------------------------------- commands

    def _transition(
        self, c: Checkpoint, event: CkptEvent, facts: frozenset[str] = frozenset()
    ) -> None:
        c.state = cast(CkptState, CHECKPOINT.next_state(c.ckpt_id, c.state, event, facts))

    def reserve(self, c: Checkpoint) -> None:
        if c.ckpt_id != self.next_id or not self.free_slots or self.free_slots[-1] != c.slot:
            raise ValueError(f"checkpoint {c.ckpt_id}: not the next id or slot")
        self.free_slots.pop()
        self.next_id += 1
        self.ckpts[c.ckpt_id] = c
        self.saves += 1

    def publish(self, c: Checkpoint, path: np.ndarray) -> None:
        self._transition(c, CkptEvent.publish)
        c.path = path
        self.index[c.key] = c.ckpt_id
        if c.frozen_block:
            tails = self.partials.setdefault(c.anchor, {})
            tails[c.step] = tails.get(c.step, 0) + 1
        self._touch(c)

    def pin(self, c: Checkpoint) -> None:
        self._transition(c, CkptEvent.pin)
        c.pins += 1
        self.restores += 1

    def unpin(self, c: Checkpoint) -> None:
        fact = "last_pin" if c.pins == 1 else "more_pins"
        self._transition(c, CkptEvent.unpin, frozenset([fact]))
        c.pins -= 1
        if c.pins == 0:
            self._touch(c)

    def remove(self, c: Checkpoint, event: CkptEvent) -> None:
        """Abandon, release or evict: the slot returns to the free stack."""
        self._transition(c, event)
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
        self.free_slots.append(c.slot)
        if event == CkptEvent.evict:
            self.evictions += 1

    def _touch(self, c: Checkpoint) -> None:
        self.clock += 1
        c.stamp = self.clock
        self.lru.append((c.stamp, c.ckpt_id))
        if len(self.lru) > 4 * (len(self.ckpts) + 16):
            self.lru = deque((s, i) for s, i in self.lru if self._evictable(s, i))

    # --------------------------------------------------------------------- invariants

    def holders(self) -> list[np.ndarray]:
        """KV references held by checkpoints: published paths and frozen blocks."""
        out: list[np.ndarray] = []
        for c in self.ckpts.values():
            if c.state != CkptState.RESERVED and len(c.path):
                out.append(c.path)
            if c.frozen_block:
                out.append(np.asarray([c.frozen_block], dtype=np.int32))
        return out

    def check_invariants(self, pins_by_ckpt: dict[int, int]) -> str | None:
        """None when consistent, else a description of the first violation."""
        owned = [c.slot for c in self.ckpts.values()]
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
        for key, ckpt_id in self.index.items():
            if ckpt_id not in self.ckpts or self.ckpts[ckpt_id].key != key:
                return f"index entry for checkpoint {ckpt_id} is stale"
        unknown = set(pins_by_ckpt) - set(self.ckpts)
        if unknown:
            return f"sequences pin unknown checkpoints {sorted(unknown)}"
        return None
