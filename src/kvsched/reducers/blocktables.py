"""BlockTables: the block tables of live sequences and the folds that change them.

The sequence table's block-table half (``SequenceTable`` builds on it): a running sequence's
blocks are its batch row's ``table[row, :nblocks]`` (``RowTable``), plus, with MTP, the
cached block of one chain index that it recomputed into a private copy (``Seq.overlap_block``
at ``Seq.overlap_at``: it holds a reference on it beside its table, in chain order just
before the copy, so it is placed and dropped by the same folds as the table). A load without
a row holds its blocks in ``LoadHoldings``; these folds leave them to it. It reads, and never
writes, the block pool (a hit's identity, routed-expert ids); its reference changes are
returned.
"""

from __future__ import annotations

from collections.abc import ValuesView

import numpy as np

from kvsched.events import types as ev
from kvsched.reducers.blocks import BlockPool
from kvsched.reducers.errors import RefChange, ReplayMismatch
from kvsched.reducers.holdings import LoadHoldings
from kvsched.reducers.rows import RowTable
from kvsched.reducers.seq import FREE_ROW, Seq

__all__ = ["BlockTables"]


class BlockTables(RowTable):
    # Set by the owner that builds on it (SequenceTable).
    seqs: dict[int, Seq]
    waiting: dict[int, Seq]
    failed: list[int]
    _pool: BlockPool
    _holdings: LoadHoldings

    def seq(self, seq_id: int) -> Seq:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise ReplayMismatch(f"sequence {seq_id} is not live") from None

    def find(self, seq_id: int) -> Seq | None:
        """The live sequence ``seq_id`` (None: not live)."""
        return self.seqs.get(seq_id)

    def is_live(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    def waiting_seqs(self) -> ValuesView[Seq]:
        """The waiting sequences, in the order they were queued (a view: no method of it
        changes the queue)."""
        return self.waiting.values()

    @property
    def has_waiting(self) -> bool:
        return bool(self.waiting)

    def failed_ids(self) -> list[int]:
        """The sequences the latest failed step computed (a copy)."""
        return list(self.failed)

    # ------------------------------------------------------------------------- queries

    def block_table(self, seq: Seq) -> np.ndarray:
        """A live sequence's block table: its row's, or, while it loads without a row, the
        blocks it holds (``LoadHoldings``)."""
        if seq.row != FREE_ROW:
            return self.blocks_of(seq.row)
        return self._holdings.blocks_of(seq.seq_id)

    def path_blocks(self, seq: Seq, lo: int, hi: int) -> np.ndarray:
        """Blocks [lo, hi) of the sequence's chain: its block table, with the cached block in
        place of its MTP private copy (a copy of the table entries)."""
        blocks = self.table[seq.row, lo:hi].copy()
        if seq.overlap_block and lo <= seq.overlap_at < hi:
            blocks[seq.overlap_at - lo] = seq.overlap_block
        return blocks

    def held_blocks(self, seq: Seq) -> np.ndarray:
        """Every block the sequence holds a reference on, in chain order (a cached MTP overlap
        block just before its private copy; none of a pinned checkpoint's path): a copy, or
        for a load without a row a read-only view."""
        if seq.row == FREE_ROW:
            return self._holdings.blocks_of(seq.seq_id)  # (a load without a row)
        held = self.table[seq.row, seq.n_pinned : self.nblocks[seq.row]].copy()
        if not seq.overlap_block:
            return held
        return np.insert(held, seq.overlap_at - seq.n_pinned, seq.overlap_block)

    # ------------------------------------------------------------------ block folds

    def _on_matched(self, e: ev.PrefixMatched) -> RefChange | None:
        """The admitted sequence's cached prefix: its blocks (the last one's digest must be
        the sequence's own there) start its block table, or its holding without a row."""
        seq = self.seq(e.seq_id)
        row, k = seq.row, len(e.blocks)
        if k and self._pool.hash_of[e.blocks.item(-1)] != seq.hashes[k - 1]:
            raise ReplayMismatch(f"sequence {seq.seq_id}: matched blocks of another prefix")
        if row == FREE_ROW:
            self._match_rowless(seq, e)
            return None
        if self.nblocks[row]:
            raise ReplayMismatch(f"sequence {e.seq_id}: prefix match outside admission")
        change = None
        if e.ckpt_id >= 0:
            if seq.pinned_ckpt != e.ckpt_id:
                raise ReplayMismatch(f"sequence {e.seq_id}: prefix of an unpinned checkpoint")
            seq.n_pinned = k  # covered by the checkpoint's references
        elif k:
            change = RefChange(attach=(e.blocks,))
        if e.overlap_block:
            change = self._hold_overlap(seq, k, e.overlap_block, change)
        self.table[row, :k] = e.blocks
        if seq.want_experts and k:
            seq.n_experts = 0
            experts = self._pool.experts
            seq.record_experts(0, np.concatenate([experts[b] for b in e.blocks.tolist()]))
        self.nblocks[row] = k
        self.computed[row] = e.num_tokens
        self.registered[row] = k
        self.saved[row] = max(int(self.saved[row]), k)  # matched blocks need no save
        seq.num_hit_tokens = e.num_tokens
        seq.kv_hit_tokens = max(e.kv_hit_tokens, 0)
        if e.num_query_tokens:  # the first admission (re-admissions query nothing)
            if e.ckpt_id >= 0:
                seq.cached_checkpoint = e.num_tokens
            else:
                seq.cached_local = e.num_tokens
        return change

    def _match_rowless(self, seq: Seq, e: ev.PrefixMatched) -> None:
        """A load without a row matched its local prefix (``LoadHoldings`` takes the blocks):
        its statistics."""
        if not self._holdings.is_rowless(seq.seq_id):
            raise ReplayMismatch(f"sequence {e.seq_id}: prefix match outside admission")
        seq.num_hit_tokens = e.num_tokens
        seq.kv_hit_tokens = max(e.kv_hit_tokens, 0)
        if e.num_query_tokens:  # the first admission (re-admissions query nothing)
            seq.cached_local = e.num_tokens

    def _hold_overlap(
        self, seq: Seq, at: int, block: int, change: RefChange | None
    ) -> RefChange:
        """MTP: the sequence holds the cached block ``block`` of chain index ``at``, which it
        recomputes into a private block."""
        if at >= len(seq.hashes) or self._pool.hash_of[block] != seq.hashes[at]:
            raise ReplayMismatch(f"sequence {seq.seq_id}: overlap block {block} of another chain")
        seq.overlap_block, seq.overlap_at = block, at
        attach = (np.asarray([block], dtype=np.int32),)
        return RefChange(attach=(change.attach if change else ()) + attach)

    # ------------------------------------------------------------------ block folds

    def _on_allocated(self, e: ev.BlocksAllocated) -> None:
        """Each sequence's new blocks extend its block table (a load without a row's: its
        holding, ``LoadHoldings``)."""
        if len(e.seq_ids) == 1:  # one sequence (an admission): no row lookup table
            if e.counts.item(0) != len(e.blocks):
                raise ReplayMismatch(f"allocation of {len(e.blocks)} blocks counted otherwise")
            grown = [(e.seq_ids.item(0), e.blocks)]
        elif len(e.seq_ids) == len(e.blocks):  # one block each (decode growth): vectorised
            rows = self.rows_of(e.seq_ids)
            n = self.nblocks[rows]
            if np.any(n >= self.table.shape[1]):
                raise ReplayMismatch("a sequence cannot take one more block")
            self.table[rows, n] = e.blocks
            self.nblocks[rows] = n + 1
            return
        else:
            bounds = np.concatenate(([0], np.cumsum(e.counts))).tolist()
            ids = e.seq_ids.tolist()
            grown = [(s, e.blocks[bounds[i] : bounds[i + 1]]) for i, s in enumerate(ids)]
        for seq_id, blocks in grown:
            seq = self.seq(seq_id)
            row, k = seq.row, len(blocks)
            if row == FREE_ROW:  # a load without a row: LoadHoldings takes them
                if not self._holdings.is_rowless(seq_id):
                    raise ReplayMismatch(f"sequence {seq_id} cannot take {k} more blocks")
                continue
            n = int(self.nblocks[row])
            if n + k > self.table.shape[1]:
                raise ReplayMismatch(f"sequence {seq_id} cannot take {k} more blocks")
            self.table[row, n : n + k] = blocks
            self.nblocks[row] = n + k

    def _on_freed(self, e: ev.BlocksFreed) -> RefChange | None:
        """Each sequence drops blocks at the tail of its block table (the entries are zeroed:
        ``set_nblocks``); a load without a row's are its holding's (``LoadHoldings`` drops
        them). Sessions' holds (negative ids) are theirs."""
        bounds = np.concatenate(([0], np.cumsum(e.counts)))
        released = []
        for i, holder in enumerate(e.seq_ids.tolist()):
            if holder < 0:
                continue
            seq, freed = self.seq(holder), e.blocks[bounds[i] : bounds[i + 1]]
            row, blocks = seq.row, freed
            if row == FREE_ROW:
                if not self._holdings.is_rowless(holder) and len(freed):
                    raise ReplayMismatch(f"sequence {holder} does not hold {freed} at its tail")
                continue
            if seq.overlap_block and seq.overlap_block in freed.tolist():
                blocks = self._drop_overlap(seq, freed)
            n, k = int(self.nblocks[row]), len(blocks)
            if k > n or not np.array_equal(self.table[row, n - k : n], blocks):
                raise ReplayMismatch(f"sequence {holder} does not hold {blocks} at its tail")
            self.table[row, n - k : n] = 0
            self.nblocks[row] = n - k
            self.registered[row] = min(int(self.registered[row]), n - k)
            self.computed[row] = min(int(self.computed[row]), (n - k) * self.block_size)
            released.append(freed)
        return RefChange(release=tuple(released)) if released else None

    def _drop_overlap(self, seq: Seq, blocks: np.ndarray) -> np.ndarray:
        """A release that includes the sequence's MTP overlap block, just before its private
        copy in chain order: the table entries it releases (the overlap is held no more)."""
        at = seq.overlap_at - (int(self.nblocks[seq.row]) - (len(blocks) - 1))
        if not 0 <= at < len(blocks) or blocks[at] != seq.overlap_block:
            raise ReplayMismatch(f"sequence {seq.seq_id}: overlap released out of chain order")
        seq.overlap_block, seq.overlap_at = 0, -1
        return np.delete(blocks, at)

    def _on_cached(self, e: ev.BlocksCached) -> RefChange:
        """Each sequence's next computed blocks enter the index (a duplicate's table entry is
        swapped for the canonical block). That the hashes are the sequence's own is an
        invariant (``invariants._check_seq``), not re-checked on this hot path."""
        rows = self.rows_of(e.seq_ids)
        starts = e.starts.astype(np.int64)
        ends = starts + e.counts
        last = ends * self.block_size
        if not np.array_equal(self.registered[rows], starts) or (
            np.any(last > self.computed[rows])
            and not (self.cache_when_planned and np.all(last <= self.planned_of(rows)))
        ):
            raise ReplayMismatch("blocks cached that are not the next computed ones")
        if len(rows) == len(e.blocks):  # one block per sequence: the decode case
            entry_rows, entry_index = rows, starts
        else:
            bounds = np.concatenate(([0], np.cumsum(e.counts)))
            entry_rows = np.repeat(rows, e.counts)
            entry_index = np.repeat(starts - bounds[:-1], e.counts) + np.arange(len(e.blocks))
        swapped = np.nonzero(e.replaced > 0)[0]
        own = e.blocks if not len(swapped) else np.where(e.replaced > 0, e.replaced, e.blocks)
        if not np.array_equal(self.table[entry_rows, entry_index], own):
            raise ReplayMismatch("blocks cached that their sequences do not hold")
        self.registered[rows] = ends
        if self.pipelined:
            self.cached_after_launch(rows, starts)
        if not len(swapped):
            return RefChange()
        self.table[entry_rows, entry_index] = e.blocks
        # One array per swap: two sequences may deduplicate onto the same block.
        attach = tuple(e.blocks[j : j + 1] for j in swapped.tolist())
        return RefChange(attach=attach, release=(e.replaced[swapped],))

    def _on_session_held(self, e: ev.SessionBlocksHeld) -> None:
        """The session takes the sequence's first blocks (the cached chain: an MTP overlap
        block instead of its private copy, which stays at the head of the table, to be
        freed with the rest)."""
        seq = self.seq(e.seq_id)
        row, k = seq.row, len(e.blocks)
        n = int(self.nblocks[row])
        if row == FREE_ROW or k > n or not np.array_equal(self.path_blocks(seq, 0, k), e.blocks):
            raise ReplayMismatch(f"sequence {e.seq_id} does not hold {e.blocks} at its head")
        rest = self.table[row, k:n].copy()
        if seq.overlap_block and seq.overlap_at < k:
            rest = np.insert(rest, 0, self.table[row, seq.overlap_at])
            seq.overlap_block, seq.overlap_at = 0, -1
        self.table[row, : len(rest)] = rest
        self.set_nblocks(row, len(rest))
        self.registered[row] = max(0, int(self.registered[row]) - k)

