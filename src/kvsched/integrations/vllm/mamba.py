"""kvsched's state slots as vLLM mamba blocks (``mamba_cache_mode="align"``; no vLLM import).

vLLM keeps a hybrid model's recurrent states in blocks of the KV cache itself: block id ``b``
is one page of every layer, so an id serves one KV cache group at a time. Before each forward
its model runner copies a request's state from mamba block ``prev`` (the last step's running
block, or ``(num_computed - 1) // block_size`` for a request it has not seen) to block
``curr = cdiv(num_computed + scheduled, block_size) - 1`` of the request's mamba block list,
and the forward updates the state there.

kvsched keeps states in slots of its own (a runtime slot per batch row, checkpoint slots) and
plans explicit copies: ``state_restore`` (checkpoint -> runtime, before the forward) and
``state_save`` (runtime -> checkpoint, after it). The mapping:

* the id space is split: ids ``[1, kv_blocks]`` are kvsched's KV blocks; each mamba group
  ``g`` has its own range holding one block per kvsched state slot (``phys[slot, g]``);
* the list sent for a sequence has ``phys[runtime]`` at ``curr`` and the null block
  elsewhere, except that a sequence restored from checkpoint ``C`` at ``k`` blocks has
  ``phys[C]`` at ``k - 1``: the runner's copy ``prev -> curr`` *is* the restore;
* a save needs no copy: after the forward the runtime block holds the state at the chunk's
  end, so it becomes the checkpoint's block and the checkpoint's old block becomes the
  runtime's (``phys`` rows swap, when the step is scheduled: ``relabel``). The next step of
  that sequence starts a new block index (saves are block-aligned:
  ``aligned_checkpoints_only``), so the runner copies the state forward into the new
  runtime block. A save before the forward (``state_save_before``: a decode-time state
  under async scheduling, named one step late) swaps before the step's lists are built:
  the state is in the runtime block already. Entries already sent are never rewritten.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def layout(
    config: Any, mamba_groups: list[int], block_size: int, num_ids: int
) -> MambaLayout | None:
    """The layout of a hybrid model's state slots in vLLM's ``num_ids`` block ids (None for
    an attention model)."""
    if not mamba_groups:
        return None
    mamba = MambaLayout(
        config.num_blocks - 1, config.num_state_slots, len(mamba_groups), block_size
    )
    assert mamba.num_ids <= num_ids
    return mamba


class MambaLayout:
    def __init__(self, kv_blocks: int, num_slots: int, num_groups: int, block_size: int) -> None:
        """``num_slots`` kvsched state slots (slot 0 the null slot), ``num_groups`` mamba
        groups; vLLM ids above ``kv_blocks`` hold the states."""
        per_group = num_slots - 1
        slots = np.arange(1, num_slots, dtype=np.int64)
        self.phys = np.zeros((num_slots, num_groups), dtype=np.int64)
        for g in range(num_groups):
            self.phys[1:, g] = kv_blocks + g * per_group + slots
        self.block_size = block_size
        self.num_ids = kv_blocks + num_groups * per_group + 1  # the null block included

    def entries(
        self, start: int, end: int, sent: int, runtime: int, restore_from: int
    ) -> list[list[int]]:
        """Per mamba group, the list entries ``[sent, cdiv(end, bs))`` for a sequence
        computing ``[start, end)`` (``restore_from``: a checkpoint slot, or 0). Empty lists
        when the running block is one already sent (it still holds ``phys[runtime]``: the
        block changes only after a save, and the step after a save starts a new block)."""
        bs = self.block_size
        curr = -(-end // bs) - 1
        if curr < sent:
            return [[] for _ in range(self.phys.shape[1])]
        if restore_from:
            at = start // bs - 1
            if start % bs or at < sent or at >= curr:
                raise ValueError(f"a restore at token {start} cannot be expressed")
        out = []
        for g in range(self.phys.shape[1]):
            row = [0] * (curr + 1 - sent)
            if restore_from:
                row[at - sent] = int(self.phys[restore_from, g])
            row[curr - sent] = int(self.phys[runtime, g])
            out.append(row)
        return out

    def blocks_of(self, slot: int) -> tuple[int, ...]:
        """The vLLM block holding state slot ``slot`` in each mamba group, now."""
        return tuple(int(b) for b in self.phys[slot])

    def saved(self, runtime: int, ckpt: int) -> None:
        """A save: the runtime block is the checkpoint's now, and vice versa."""
        self.phys[[runtime, ckpt]] = self.phys[[ckpt, runtime]]

    def relabel(self, saves: np.ndarray, check: bool = False) -> None:
        """Each (runtime slot, checkpoint slot) of a step's ``saves`` (``saved``), when the
        step is scheduled: ``state_save_before`` ones before its block lists are built
        (the state is in the runtime block already), ``state_save`` ones after (the block
        the step writes is the checkpoint's). Not when its output comes back: under vLLM's
        async scheduling the next step is scheduled before that, and its lists must name
        the new runtime block (the step after a save starts a new block index, and the
        runner copies the saved state forward into it)."""
        for runtime, ckpt in saves.tolist():
            self.saved(runtime, ckpt)
        if check and len(saves):
            self.check()

    def check(self) -> None:
        ids = self.phys[1:].ravel()
        if len(np.unique(ids)) != len(ids):
            raise AssertionError("two state slots share a vLLM block")


class GroupTables:
    """A scheduled sequence's block ids as vLLM sends them: one list per KV cache group,
    kvsched's block table for the full-attention group and the ``MambaLayout`` entries for
    each mamba group (attention only: the table alone)."""

    def __init__(
        self,
        attn_group: int,
        mamba_groups: list[int],
        num_groups: int,
        layout: MambaLayout | None,
    ) -> None:
        self.attn_group = attn_group
        self.mamba_groups = mamba_groups
        self.num_groups = num_groups
        self.layout = layout

    def ids(
        self, attn: list[int], start: int, end: int, sent: int, slot: int, restore: dict[int, int]
    ) -> tuple[list[int], ...]:
        """The lists for a sequence computing ``[start, end)`` whose entries before ``sent``
        the worker holds; ``slot`` its runtime state slot, ``restore`` checkpoint slot by the
        runtime slot it is restored into."""
        if self.layout is None:
            return (attn,)
        out: list[list[int]] = [[] for _ in range(self.num_groups)]
        out[self.attn_group] = attn
        rows = self.layout.entries(start, end, sent, slot, restore.get(slot, 0))
        for g, row in zip(self.mamba_groups, rows, strict=True):
            out[g] = row
        return tuple(out)
