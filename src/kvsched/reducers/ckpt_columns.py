"""CheckpointColumns: the checkpoint records as numpy columns indexed by state slot.

``CheckpointTable`` owns one and writes it in its own folds (``write`` after a fold that
changes a checkpoint, ``clear`` when a checkpoint leaves): it is an index of the table's
records, never written by anyone else. It exists so that a strategy that orders every
evictable checkpoint (eviction ``value``, ``policy/eviction.py``) reads them in a few
vectorised operations instead of a Python pass over the records at each decision.

A row is a checkpoint slot (``slot`` of its record): ``live`` (reserved, published or pinned),
``evictable`` (published and unpinned: the table's ``evictable`` set), its id, producer, step,
cost, hits, aging floor and LRU stamp at its last touch, and its placement rule as a code
(``kinds``: the rule names in the order the table first saw them).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# (ckpt id, producer, step, cost, hits, aging floor, LRU stamp, placement rule)
Record = tuple[int, int, int, int, int, float, int, str]


class ColumnsView(NamedTuple):
    """Read-only views of the columns (``CheckpointTable.value_columns``)."""

    live: np.ndarray
    evictable: np.ndarray
    ckpt_id: np.ndarray
    seq_id: np.ndarray
    step: np.ndarray
    cost: np.ndarray
    hits: np.ndarray
    floor: np.ndarray
    stamp: np.ndarray
    kind: np.ndarray
    kinds: tuple[str, ...]


class CheckpointColumns:
    """Per-slot columns of the checkpoint records (written only by ``CheckpointTable``)."""

    def __init__(self, num_slots: int) -> None:
        self.live = np.zeros(num_slots, dtype=bool)
        self.evictable = np.zeros(num_slots, dtype=bool)
        self.ckpt_id = np.zeros(num_slots, dtype=np.int64)
        self.seq_id = np.zeros(num_slots, dtype=np.int64)
        self.step = np.zeros(num_slots, dtype=np.int64)
        self.cost = np.ones(num_slots, dtype=np.int64)
        self.hits = np.zeros(num_slots, dtype=np.int64)
        self.floor = np.zeros(num_slots, dtype=np.float64)
        self.stamp = np.zeros(num_slots, dtype=np.int64)
        self.kind = np.zeros(num_slots, dtype=np.int16)
        self.codes: dict[str, int] = {}  # rule name -> code, in the order first seen
        self._view = self._views()  # (the arrays are never replaced: views stay valid)

    def code(self, kind: str) -> int:
        """The code of placement rule ``kind`` (a new rule gets the next code)."""
        code = self.codes.get(kind)
        if code is None:
            code = self.codes[kind] = len(self.codes)
            self._view = self._views()
        return code

    def write(
        self,
        slot: int,
        record: Record,
        evictable: bool,
    ) -> None:
        """Row ``slot`` := ``record`` (ckpt id, producer, step, cost, hits, floor, stamp,
        rule), live, and ``evictable`` or not."""
        ckpt_id, seq_id, step, cost, hits, floor, stamp, kind = record
        self.live[slot] = True
        self.evictable[slot] = evictable
        self.ckpt_id[slot] = ckpt_id
        self.seq_id[slot] = seq_id
        self.step[slot] = step
        self.cost[slot] = cost
        self.hits[slot] = hits
        self.floor[slot] = floor
        self.stamp[slot] = stamp
        self.kind[slot] = self.code(kind)

    def clear(self, slot: int) -> None:
        """Row ``slot`` holds no checkpoint any more."""
        self.live[slot] = False
        self.evictable[slot] = False

    def row(self, slot: int) -> tuple[Record, bool]:
        """Row ``slot`` as ``write`` took it: (record, evictable)."""
        names = {code: kind for kind, code in self.codes.items()}
        record = (
            int(self.ckpt_id[slot]), int(self.seq_id[slot]), int(self.step[slot]),
            int(self.cost[slot]), int(self.hits[slot]), float(self.floor[slot]),
            int(self.stamp[slot]), names[int(self.kind[slot])],
        )  # fmt: skip
        return record, bool(self.evictable[slot])

    def mismatch(self, rows: dict[int, tuple[Record, bool]]) -> str | None:
        """None when the live rows are exactly ``rows`` (slot -> (record, evictable)), else
        the first difference."""
        live = set(np.flatnonzero(self.live).tolist())
        if live != set(rows):
            return f"checkpoint columns: live slots {sorted(live ^ set(rows))} disagree"
        for slot, row in rows.items():
            if self.row(slot) != row:
                return f"checkpoint columns: slot {slot} holds {self.row(slot)}, not {row}"
        return None

    def view(self) -> ColumnsView:
        """Read-only views of every column (their values change with the next fold)."""
        return self._view

    def _views(self) -> ColumnsView:
        return ColumnsView(
            _frozen(self.live), _frozen(self.evictable), _frozen(self.ckpt_id),
            _frozen(self.seq_id), _frozen(self.step), _frozen(self.cost), _frozen(self.hits),
            _frozen(self.floor), _frozen(self.stamp), _frozen(self.kind), tuple(self.codes),
        )  # fmt: skip


def _frozen(column: np.ndarray) -> np.ndarray:
    """A read-only view of ``column``."""
    view = column.view()
    view.flags.writeable = False
    return view
