"""BlockPool: KV block reference counts, free stack, prefix index and LRU reuse order.

Every block is in exactly one of three conditions:

* **free**: reference count 0, no identity, on the free stack;
* **cached**: reference count 0, registered in the prefix index, evictable (on the LRU queue);
* **held**: reference count > 0 (registered or private).

Block 0 is the null block: never allocated, used by plans as padding.

The pool folds its own events: ``BlocksAllocated`` (and a checkpoint's frozen block) take
blocks off the free stack, ``BlocksEvicted`` turns cached unheld blocks free, ``BlocksCached``
registers computed blocks, ``CacheCleared`` forgets every identity. Reference counts change
only through ``apply`` of the ``RefChange`` a holder's fold returns.

Prefix closure: a block is registered only while its parent hash is registered, and evicted
only when no cached child remains. Holders of a cached block always hold its cached parent
too, and releases drop a sequence's blocks leaf first, so the LRU queue (ordered by release)
offers a child before its parent; ``cached_prefix`` can binary-search a request's chain.
The pool chooses no victim: it offers the evictable blocks in that order
(``evictable_blocks``) and the policy's block eviction strategy (``policy/eviction.py``)
picks among them.

Prefix paths: each cached block at depth d knows its chain's path and d, where
``path[: d + 1]`` are the canonical blocks of its prefix, root first: an array shared by the
cached blocks of one chain, whose written entries never change (read-only views of them are
handed out and kept: a prefix match's blocks, a checkpoint's path, events). A chain that grows
at its tip writes the path's next unwritten entry (``NULL_BLOCK``) in place; a branch, or a
tip at the end of its array, copies the shared part into a new one. A match of k blocks is
one lookup of the deepest hash and a read-only view of its path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from itertools import repeat
from typing import Any

import numpy as np

from kvsched.events import types as ev
from kvsched.events.types import HASH_SIZE, split_hashes
from kvsched.identity import HashChain
from kvsched.reducers.errors import RefChange, ReplayMismatch

NULL_BLOCK = 0

class BlockPoolError(RuntimeError):
    """A block operation that would break the pool's invariants."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 64) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.parent_of: list[bytes | None] = [None] * num_blocks  # namespace root at depth 0
        # A cached block's chain path and its depth in it, in two parallel columns (no
        # per-block tuple: a cache of many blocks would burden the garbage collector).
        self.path_of: list[np.ndarray | None] = [None] * num_blocks
        self.depth_of = np.zeros(num_blocks, dtype=np.int64)
        self.children = np.zeros(num_blocks, dtype=np.int32)  # cached children per block
        # MoE: routed-expert ids recorded when a cached block was computed ([bs, K] int16).
        self.experts: dict[int, np.ndarray] = {}
        self.index: dict[bytes, int] = {}
        # Stack: the top (end) is allocated first; block 1 comes out first.
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))
        # LRU of cached blocks with no holder, as (release stamp, block); stale entries are
        # skipped lazily (the block was re-attached, re-released or evicted since).
        self.lru: deque[tuple[int, int]] = deque()
        self.stamp = np.zeros(num_blocks, dtype=np.int64)
        self.clock = 0
        self.num_evictable = 0
        self.num_evictions = 0

    def folds(self) -> dict[type[ev.Event], Callable[[Any], RefChange | None]]:
        return {
            ev.BlocksAllocated: self._on_allocated,
            ev.BlocksEvicted: self._on_evicted,
            ev.BlocksCached: self._on_cached,
            ev.CacheCleared: self._on_cleared,
            ev.CheckpointReserved: self._on_ckpt_reserved,
        }

    # ------------------------------------------------------------------ queries (pure)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free plus evictable cached blocks."""
        return len(self.free) + self.num_evictable

    @property
    def num_free(self) -> int:
        """Blocks with no identity and no holder (an allocation of at most these evicts
        nothing)."""
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.index)

    def cached_prefix(self, hashes: HashChain, limit: int) -> np.ndarray:
        """Block ids of the longest cached prefix of ``hashes[:limit]``: a binary search of the
        index (it is prefix-closed), one lookup of the deepest hash and a read-only view of
        its path (no walk over the prefix)."""
        count = hashes.longest_prefix_in(self.index, limit)
        if count == 0:
            return np.zeros(0, dtype=np.int32)
        block = self.index[hashes[count - 1]]
        path = self.path_of[block]
        assert path is not None and self.depth_of[block] == count - 1
        view = path[:count]
        view.flags.writeable = False
        return view

    def path_to(self, block: int) -> np.ndarray:
        """The canonical blocks of a cached block's prefix, ending at it (read-only view)."""
        path = self.path_of[block]
        assert path is not None
        view = path[: int(self.depth_of[block]) + 1]
        view.flags.writeable = False
        return view

    def count_with_experts(self, blocks: np.ndarray) -> int:
        """How many leading blocks carry routed-expert ids."""
        experts = self.experts
        for i, block in enumerate(blocks.tolist()):
            if block not in experts:
                return i
        return len(blocks)

    def cached_block(self, h: bytes) -> int | None:
        """The block cached under identity ``h`` (None: not cached)."""
        return self.index.get(h)

    def is_cached(self, h: bytes) -> bool:
        return h in self.index

    def has_experts(self, block: int) -> bool:
        """Whether the cached block carries routed-expert ids."""
        return block in self.experts

    def is_unheld(self, block: int) -> bool:
        """Whether nobody holds a reference on the block."""
        return bool(self.ref[block] == 0)

    def freed_by(self, drops: np.ndarray) -> np.ndarray:
        """Which blocks dropping ``drops[b]`` references each (a count per block id) would
        leave unheld: those whose every reference is dropped (a new boolean array)."""
        freed: np.ndarray = (drops > 0) & (self.ref == drops)
        return freed

    def count_unheld(self, blocks: np.ndarray) -> int:
        """How many of these cached blocks are evictable now (attaching them removes them)."""
        return int(np.count_nonzero(self.ref[blocks] == 0))

    def _live(self, stamp: int, block: int) -> bool:
        return (
            self.stamp[block] == stamp
            and self.ref[block] == 0
            and self.hash_of[block] is not None
        )

    def evictable_blocks(self) -> Iterator[int]:
        """The cached blocks nobody holds, least recently released first: a block's cached
        children before it (the candidates an eviction strategy chooses from)."""
        return (b for s, b in self.lru if self._live(s, b))

    def free_top(self, n: int) -> np.ndarray:
        """The ``n`` blocks an allocation takes from the free stack, in the order it takes
        them (``n`` <= ``num_free``; blocks evicted for an allocation come before them)."""
        return np.asarray(self.free[len(self.free) - n :][::-1], dtype=np.int32)

    def hashes_of(self, blocks: np.ndarray) -> bytes:
        out = []
        for b in blocks.tolist():
            h = self.hash_of[b]
            assert h is not None
            out.append(h)
        return b"".join(out)

    # -------------------------------------------------------------------------- folds

    def _on_allocated(self, e: ev.BlocksAllocated) -> None:
        """Take exactly the allocated blocks, which must be the top of the free stack."""
        blocks = e.blocks
        n = len(blocks)
        if n > len(self.free):
            raise ReplayMismatch(f"allocation of {n} blocks: {len(self.free)} free")
        top = self.free[len(self.free) - n :][::-1]
        if (top[0] != blocks.item(0)) if n == 1 else (top != blocks.tolist()):
            raise ReplayMismatch(f"allocation would take {top}, event says {blocks.tolist()}")
        del self.free[len(self.free) - n :]
        if n == 1:
            self.ref[top[0]] = 1
        else:
            self.ref[blocks] = 1

    def _on_ckpt_reserved(self, e: ev.CheckpointReserved) -> None:
        """Take the checkpoint's frozen block (if any), which must be the top of the free
        stack."""
        block = e.frozen_block
        if not block:
            return
        if not self.free or self.free[-1] != block:
            top = self.free[-1:]
            raise ReplayMismatch(f"a frozen block would be {top}, event says {block}")
        self.free.pop()
        self.ref[block] = 1

    def _on_evicted(self, e: ev.BlocksEvicted) -> None:
        blocks = e.blocks.tolist()
        if split_hashes(e.hashes) != [self.hash_of[b] for b in blocks]:
            raise ReplayMismatch(f"eviction of {blocks}: hashes disagree with the index")
        for b in blocks:  # leaf first: a block's cached children are evicted before it
            if self.ref[b] or self.children[b]:
                raise ReplayMismatch(f"block {b} is held or has cached children: not evictable")
            self._uncache(b)
            self.num_evictable -= 1
            self.num_evictions += 1
        self.free.extend(reversed(blocks))  # the next allocation takes them in event order
        while self.lru and not self._live(*self.lru[0]):
            self.lru.popleft()

    def _on_cached(self, e: ev.BlocksCached) -> None:
        """Register the computed blocks: each under its hash, at its depth below its cached
        parent (prefix closure), on its parent's path (written in place at the path's tip,
        else a new path with a copy of the shared prefix), except the entries it does not
        register (``_unregistered``, checked); keep the routed-expert ids it brings."""
        hashes, parents = split_hashes(e.hashes), split_hashes(e.parents)
        if len(hashes) != len(e.blocks):  # (a block past its sequence's known tokens)
            raise ReplayMismatch(f"{len(e.blocks)} blocks cached with {len(hashes)} hashes")
        if len(e.seq_ids) == len(e.blocks):
            depths = e.starts.tolist()  # one block per sequence
        else:
            bounds = np.concatenate(([0], np.cumsum(e.counts, dtype=np.int64)))
            steps = np.repeat(e.starts - bounds[:-1], e.counts) + np.arange(len(e.blocks))
            depths = steps.tolist()
        blocks = e.blocks.tolist()
        replaced = e.replaced.tolist() if e.replaced.any() else None
        for j, block in enumerate(blocks):
            h, depth = hashes[j], depths[j]
            if replaced is not None and self._unregistered(block, h, replaced[j]):
                continue
            if h in self.index or self.hash_of[block] is not None:
                raise ReplayMismatch(f"block {block}: hash already cached or block has an identity")
            if not self.ref[block]:
                raise ReplayMismatch(f"block {block} is registered but nobody holds it")
            path = None
            if depth:
                pb = self.index.get(parents[j])
                if pb is None:
                    raise ReplayMismatch(f"block {block}: parent not cached (prefix closure)")
                path, d = self.path_of[pb], int(self.depth_of[pb])
                assert path is not None
                if d != depth - 1:
                    raise ReplayMismatch(f"block {block}: depth {depth} under a parent at {d}")
                self.children[pb] += 1
            if path is None or depth == len(path) or path[depth] != NULL_BLOCK:
                grown = np.zeros(max(16, 2 * (depth + 1)), dtype=np.int32)
                if path is not None:
                    grown[:depth] = path[:depth]
                path = grown
            path[depth] = block
            self.parent_of[block] = parents[j]  # (the namespace root at depth 0)
            self.index[h] = block
            self.hash_of[block] = h
            self.path_of[block] = path
            self.depth_of[block] = depth
        marked = np.nonzero(e.with_experts)[0].tolist() if len(e.with_experts) else []
        per = len(e.experts) // len(marked) if marked else 0
        for m, j in enumerate(marked):
            if blocks[j] not in self.experts:
                ids = e.experts[m * per : (m + 1) * per]
                self.experts[blocks[j]] = ids.reshape(self.block_size, -1)

    def _unregistered(self, block: int, h: bytes, kind: int) -> bool:
        """Whether a cached entry (``kind``: its ``replaced`` marker) is not registered, after
        checking it: deduplicated onto the cached block (``kind`` > 0: the copy it replaces),
        a private copy of a hash cached elsewhere, or a block that stays unindexed."""
        if kind > 0:
            if self.index.get(h) != block:
                raise ReplayMismatch(f"dedup onto block {block}, which lacks that hash")
        elif kind == ev.PRIVATE_COPY:
            if self.index.get(h, block) == block:
                raise ReplayMismatch(f"private copy {block} of a hash not cached elsewhere")
        elif kind == ev.UNINDEXED:
            if self.hash_of[block] is not None:
                raise ReplayMismatch(f"block {block} is cached: it cannot stay unindexed")
        else:
            return False
        return True

    def _on_cleared(self, e: ev.CacheCleared) -> None:
        if self.ref.any():
            raise ReplayMismatch("cache cleared while blocks are held")
        n = self.num_blocks
        self.index.clear()
        self.hash_of, self.parent_of, self.path_of = [None] * n, [None] * n, [None] * n
        self.children[:] = 0
        self.experts.clear()
        self.lru.clear()
        self.num_evictable = 0
        self.free = list(range(self.num_blocks - 1, 0, -1))

    def _uncache(self, block: int) -> None:
        h = self.hash_of[block]
        assert h is not None
        del self.index[h]
        depth = int(self.depth_of[block])
        # Its path keeps the entry: views of a path are handed out (prefix matches, checkpoint
        # paths) and must never change, so a later block at this depth starts a new path.
        if depth:
            parent = self.parent_of[block]
            assert parent is not None
            self.children[self.index[parent]] -= 1
        self.hash_of[block] = None
        self.parent_of[block] = None
        self.path_of[block] = None
        self.experts.pop(block, None)

    # ------------------------------------------------------------ reference changes

    def apply(self, change: RefChange) -> None:
        """Apply a holder's reference change: one reference more on each block of its
        ``attach`` arrays (distinct ids; cached ones leave the LRU), then one less on each
        block of its ``release`` arrays (in block-table order, root first): a block left
        unheld goes on the LRU queue (leaf first) if it is cached, else on the free stack."""
        for blocks in change.attach:
            refs = self.ref[blocks]
            # Only cached blocks are unheld (reference 0): they leave the evictable count.
            self.num_evictable -= len(refs) - int(np.count_nonzero(refs))
            refs += 1
            self.ref[blocks] = refs
        for blocks in change.release:
            if len(blocks) == 0:
                continue
            refs = self.ref[blocks] - 1
            if refs.min() < 0:
                raise ReplayMismatch(f"release of an unreferenced block in {blocks.tolist()}")
            self.ref[blocks] = refs
            zero = blocks[refs == 0][::-1].tolist()  # leaf first
            if not zero:
                continue
            self.clock += 1
            cached = [b for b in zero if self.hash_of[b] is not None]
            if cached:
                self.stamp[cached] = self.clock
                self.lru.extend(zip(repeat(self.clock), cached, strict=False))
                self.num_evictable += len(cached)
                if len(self.lru) > 4 * self.num_blocks:
                    self.lru = deque((s, b) for s, b in self.lru if self._live(s, b))
            if len(cached) < len(zero):
                self.free.extend(b for b in zero if self.hash_of[b] is None)

    # -------------------------------------------------------------------- invariants

    def check_invariants(self, holders: list[np.ndarray]) -> None:
        """Check the pool against every reference holder's block list."""
        expect = np.zeros(self.num_blocks, dtype=np.int64)
        for blocks in holders:
            if len(np.unique(blocks)) != len(blocks):
                raise BlockPoolError(f"a holder references a block twice: {blocks.tolist()}")
            np.add.at(expect, blocks, 1)
        if expect[NULL_BLOCK] or self.ref[NULL_BLOCK]:
            raise BlockPoolError("the null block is referenced")
        bad = np.nonzero(expect != self.ref)[0]
        if len(bad):
            b = int(bad[0])
            raise BlockPoolError(
                f"block {b}: reference count {self.ref[b]} but {expect[b]} references"
            )
        free = np.asarray(self.free, dtype=np.int64)
        if len(set(self.free)) != len(self.free):
            raise BlockPoolError("a block is on the free list twice")
        if len(free) and (self.ref[free].any() or any(self.hash_of[b] for b in self.free)):
            raise BlockPoolError("a free block is referenced or cached")
        self._check_index()
        hashed = np.fromiter((h is not None for h in self.hash_of), bool, self.num_blocks)
        evictable = int(np.count_nonzero(hashed & (self.ref == 0)))
        if evictable != self.num_evictable:
            raise BlockPoolError(f"{self.num_evictable} evictable counted, {evictable} found")
        live = {b for s, b in self.lru if self._live(s, b)}
        if len(live) != evictable:
            raise BlockPoolError("an evictable block is missing from the LRU queue")
        unowned = self.num_blocks - 1 - int(np.count_nonzero(self.ref)) - evictable
        if unowned != len(self.free):
            raise BlockPoolError(f"{unowned} blocks unowned but {len(self.free)} on free list")

    def _check_index(self) -> None:
        children = np.zeros(self.num_blocks, dtype=np.int32)
        for h, b in self.index.items():
            if self.hash_of[b] != h:
                raise BlockPoolError(f"index entry for block {b} disagrees with its identity")
            path, depth = self.path_of[b], int(self.depth_of[b])
            if path is None or depth >= len(path) or path[depth] != b:
                raise BlockPoolError(f"block {b}: its prefix path does not end at it")
            parent = self.parent_of[b]
            if depth:
                if parent is None or parent not in self.index:
                    raise BlockPoolError(f"block {b} is cached but its parent is not")
                children[self.index[parent]] += 1
                if self.index[parent] != path[depth - 1]:
                    raise BlockPoolError(f"block {b}: its prefix path disagrees with its parent")
        if not np.array_equal(children, self.children):
            raise BlockPoolError("cached-children counts disagree with the index")

    def snapshot(self) -> tuple[object, ...]:
        """Everything the pool holds, for whole-state comparisons in tests."""
        live = [(s, b) for s, b in self.lru if self._live(s, b)]
        return (
            self.ref.tobytes(),
            tuple(self.hash_of),
            tuple(self.parent_of),
            tuple(self.free),
            tuple(live),
            self.stamp.tobytes(),
            self.clock,
            self.num_evictable,
            self.num_evictions,
            self.children.tobytes(),
            tuple((b, a.tobytes()) for b, a in sorted(self.experts.items())),
        )


__all__ = ["HASH_SIZE", "NULL_BLOCK", "BlockPool", "BlockPoolError"]
