"""LoadHoldings: the blocks held by external-KV loads that have no batch row.

A load admitted without a row (``KVLoadAdmitted`` with no row: ``load_admission="soft"``)
holds blocks before it runs: its local prefix (``PrefixMatched``: cached blocks, the
leading ``cached`` of them), then the blocks it loads into (``BlocksAllocated``). It keeps
them until it is settled into a row (``KVLoadSettled``: the sequence table copies them into
the row's block table, and this owner forgets them) or released (``BlocksFreed``) before it
leaves (``SequencePreempted`` / ``SequenceFinished`` / ``SequenceAborted``: nothing may be
left then). A holding is entered at its admission and removed when it is settled or leaves,
so membership alone tells a rowless load (``is_rowless``); this owner reads no other.

The references it takes or drops are returned to the block pool, like every holder's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from kvsched.events import types as ev
from kvsched.reducers.errors import RefChange, ReplayMismatch
from kvsched.reducers.seq import FREE_ROW
from kvsched.reducers.seq import NO_BLOCKS as _NONE

__all__ = ["Holding", "LoadHoldings"]


@attrs.define(slots=True, eq=False)
class Holding:
    """The blocks one rowless load holds, in chain order; the leading ``cached`` are its
    local prefix (cached blocks of its own identities)."""

    blocks: np.ndarray = _NONE
    cached: int = 0


class LoadHoldings:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks  # a holding never exceeds a block table's width
        self.loads: dict[int, Holding] = {}  # sequence id -> its holding (insertion order)

    def folds(self) -> dict[type[ev.Event], Callable[[Any], RefChange | None]]:
        return {
            ev.KVLoadAdmitted: self._on_load_admitted,
            ev.PrefixMatched: self._on_matched,
            ev.BlocksAllocated: self._on_allocated,
            ev.BlocksFreed: self._on_freed,
            ev.KVLoadSettled: self._on_load_settled,
            ev.SequencePreempted: self._on_left,
            ev.SequenceFinished: self._on_finished,
            ev.SequenceAborted: self._on_left,
        }

    # ------------------------------------------------------------------------- queries

    def is_rowless(self, seq_id: int) -> bool:
        """Whether the sequence is a load admitted without a batch row, not yet settled."""
        return seq_id in self.loads

    def blocks_of(self, seq_id: int) -> np.ndarray:
        """The blocks a rowless load holds (none for any other sequence; a read-only view)."""
        holding = self.loads.get(seq_id)
        if holding is None:
            return _NONE
        view = holding.blocks.view()
        view.flags.writeable = False
        return view

    def cached_of(self, seq_id: int) -> int:
        holding = self.loads.get(seq_id)
        return 0 if holding is None else holding.cached

    def holders(self) -> list[np.ndarray]:
        """The blocks held by rowless loads (for the reference-count check)."""
        return [h.blocks for h in self.loads.values() if len(h.blocks)]

    # -------------------------------------------------------------------------- folds

    def _on_load_admitted(self, e: ev.KVLoadAdmitted) -> None:
        if e.row == FREE_ROW:
            if e.seq_id in self.loads:
                raise ReplayMismatch(f"sequence {e.seq_id}: admitted twice without a row")
            self.loads[e.seq_id] = Holding()

    def _on_matched(self, e: ev.PrefixMatched) -> RefChange | None:
        """A rowless load attaches its local prefix (the sequence table checks that the
        prefix is its own and that it is loading)."""
        holding = self.loads.get(e.seq_id)
        if holding is None:
            return None
        if len(holding.blocks) or e.ckpt_id >= 0 or e.overlap_block:
            raise ReplayMismatch(f"sequence {e.seq_id}: prefix match outside admission")
        holding.blocks = np.array(e.blocks, dtype=np.int32)
        holding.cached = len(e.blocks)
        return RefChange(attach=(e.blocks,)) if len(e.blocks) else None

    def _on_allocated(self, e: ev.BlocksAllocated) -> None:
        """A rowless load takes the blocks it loads into (the pool counts the references)."""
        if not self.loads:
            return
        bounds = np.concatenate(([0], np.cumsum(e.counts))).tolist()
        for i, seq_id in enumerate(e.seq_ids.tolist()):
            holding = self.loads.get(seq_id)
            if holding is None:
                continue
            blocks = e.blocks[bounds[i] : bounds[i + 1]]
            if len(holding.blocks) + len(blocks) > self.max_blocks:
                raise ReplayMismatch(f"sequence {seq_id} cannot take {len(blocks)} more blocks")
            holding.blocks = np.concatenate((holding.blocks, blocks)).astype(np.int32)

    def _on_freed(self, e: ev.BlocksFreed) -> RefChange | None:
        """A rowless load drops the tail of the blocks it holds."""
        if not self.loads:
            return None
        bounds = np.concatenate(([0], np.cumsum(e.counts)))
        released = []
        for i, holder in enumerate(e.seq_ids.tolist()):
            holding = self.loads.get(holder)
            if holding is None:
                continue
            blocks = e.blocks[bounds[i] : bounds[i + 1]]
            n, k = len(holding.blocks), len(blocks)
            if k > n or not np.array_equal(holding.blocks[n - k :], blocks):
                raise ReplayMismatch(f"sequence {holder} does not hold {blocks} at its tail")
            holding.blocks = holding.blocks[: n - k].copy()
            holding.cached = min(holding.cached, n - k)
            released.append(blocks)
        return RefChange(release=tuple(released)) if released else None

    def _on_load_settled(self, e: ev.KVLoadSettled) -> None:
        """Settled into a row: its blocks are the row's now (the sequence table, folding
        before this owner, copied them into the row's block table)."""
        if e.seq_id in self.loads:
            del self.loads[e.seq_id]

    def _leave(self, seq_id: int) -> None:
        holding = self.loads.pop(seq_id, None)
        if holding is not None and len(holding.blocks):
            raise ReplayMismatch(
                f"sequence {seq_id} left holding blocks: BlocksFreed must release a load's "
                "blocks before it ends"
            )

    def _on_left(self, e: ev.SequencePreempted | ev.SequenceAborted) -> None:
        self._leave(e.seq_id)

    def _on_finished(self, e: ev.SequenceFinished) -> None:
        if self.loads:
            for seq_id in e.seq_ids.tolist():
                self._leave(seq_id)

    # --------------------------------------------------------------------- invariants

    def check_invariants(self, loading_rowless: set[int]) -> str | None:
        """None when consistent (a holding for exactly the rowless loads, each within a block
        table, its cached prefix within it, no block twice), else the first violation."""
        if set(self.loads) != loading_rowless:
            return (
                f"holdings of {sorted(self.loads)}, loads without a row {sorted(loading_rowless)}"
            )
        for seq_id, h in self.loads.items():
            n = len(h.blocks)
            if n > self.max_blocks or not 0 <= h.cached <= n:
                return f"load of {seq_id}: {n} blocks held, {h.cached} cached"
            if len(np.unique(h.blocks)) != n:
                return f"load of {seq_id} holds a block twice"
        return None

    def snapshot(self) -> tuple[object, ...]:
        return tuple((k, h.blocks.tobytes(), h.cached) for k, h in self.loads.items())
