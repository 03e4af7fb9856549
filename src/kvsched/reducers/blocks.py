"""BlockPool: KV block reference counts, free list, prefix index and LRU reuse order.

Every block is in exactly one of three conditions:

* **free**: reference count 0, no identity, on the free stack;
* **cached**: reference count 0, registered in the prefix index, evictable (on the LRU queue);
* **held**: reference count > 0 (registered or private).

Block 0 is the null block: never allocated, used by plans as padding.

Prefix closure: a block is registered only while its parent hash is registered. Holders of a
cached block always hold its cached parent too, so a parent's reference count is never below a
child's; a release drops a sequence's blocks leaf first, so the LRU queue (ordered by release)
always evicts a child before its parent, and the index stays prefix-closed. That is what lets
``find_prefix_len`` binary-search a request's hash chain.
"""

from __future__ import annotations

from collections import deque
from itertools import islice, repeat

import numpy as np

NULL_BLOCK = 0


class BlockPoolError(RuntimeError):
    """A block operation that would break the pool's invariants."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.parent_of: list[bytes | None] = [None] * num_blocks
        # For a cached block at depth i: (path, i), where path[: i + 1] are the cached blocks
        # of its prefix, root first. The registering sequence's path array is shared, never
        # copied; its first i + 1 entries never change while the block stays cached (a cached
        # block's ancestors cannot be evicted before it).
        self.path_of: list[tuple[np.ndarray, int] | None] = [None] * num_blocks
        # MoE: routed-expert ids recorded when a cached block was computed ([bs, K] int16).
        self.experts: dict[int, np.ndarray] = {}
        self.index: dict[bytes, int] = {}
        # Stack: the top (end) is allocated first; block 1 comes out first.
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))
        # LRU of cached blocks with no holder, as (release stamp, block); stale entries are
        # skipped lazily (the block was re-attached or re-released since).
        self.lru: deque[tuple[int, int]] = deque()
        self.stamp = np.zeros(num_blocks, dtype=np.int64)
        self.clock = 0
        self.num_evictable = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries (pure)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free plus evictable cached blocks."""
        return len(self.free) + self.num_evictable

    def find_prefix_len(self, hashes: list[bytes], limit: int) -> int:
        """Number of leading blocks of ``hashes[:limit]`` in the index (binary search)."""
        index = self.index
        hi = min(limit, len(hashes))
        if hi <= 0 or hashes[0] not in index:
            return 0
        lo = 1  # hashes[:lo] cached; answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in index:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def find_blocks(self, hashes: list[bytes], count: int) -> np.ndarray:
        """Block ids of the first ``count`` hashes, all cached: one lookup of the deepest hash
        and a read-only view of its path (no walk over the prefix)."""
        if count == 0:
            return np.zeros(0, dtype=np.int32)
        entry = self.path_of[self.index[hashes[count - 1]]]
        assert entry is not None and entry[1] == count - 1
        view = entry[0][:count]
        view.flags.writeable = False
        return view

    def count_with_experts(self, blocks: np.ndarray) -> int:
        """How many leading blocks carry routed-expert ids."""
        experts = self.experts
        for i, block in enumerate(blocks.tolist()):
            if block not in experts:
                return i
        return len(blocks)

    def count_unheld(self, blocks: np.ndarray) -> int:
        """How many of these cached blocks are evictable now (attaching them removes them)."""
        return int(np.count_nonzero(self.ref[blocks] == 0))

    def _live(self, stamp: int, block: int) -> bool:
        return (
            self.stamp[block] == stamp
            and self.ref[block] == 0
            and self.hash_of[block] is not None
        )

    def peek_allocate(self, n: int) -> np.ndarray | None:
        """The blocks ``allocate(n)`` would return, or None when fewer are available."""
        if n > self.num_available:
            return None
        take = min(n, len(self.free))
        out = self.free[len(self.free) - take :][::-1]
        if take < n:
            live = (b for s, b in self.lru if self._live(s, b))
            out.extend(islice(live, n - take))
        return np.asarray(out, dtype=np.int32)

    # ---------------------------------------------------------------- commands (reducer)

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` blocks: free ones first, then evict least recently released cached ones."""
        if n > self.num_available:
            raise BlockPoolError(f"cannot allocate {n} blocks: {self.num_available} available")
        take = min(n, len(self.free))
        out = self.free[len(self.free) - take :][::-1]
        del self.free[len(self.free) - take :]
        while len(out) < n:
            stamp, block = self.lru.popleft()
            if self._live(stamp, block):
                self._uncache(block)
                self.num_evictable -= 1
                self.num_evictions += 1
                out.append(block)
        blocks = np.asarray(out, dtype=np.int32)
        self.ref[blocks] = 1
        return blocks

    def attach(self, blocks: np.ndarray) -> None:
        """Add one reference to each block (distinct ids; cached ones leave the LRU)."""
        refs = self.ref[blocks]
        self.num_evictable -= int(np.count_nonzero(refs == 0))
        self.ref[blocks] = refs + 1

    def release(self, blocks: np.ndarray) -> None:
        """Drop one reference from each block, given in block-table order (root first)."""
        if len(blocks) == 0:
            return
        refs = self.ref[blocks] - 1
        if refs.min() < 0:
            raise BlockPoolError(f"release of an unreferenced block in {blocks.tolist()}")
        self.ref[blocks] = refs
        zero = blocks[refs == 0][::-1].tolist()  # leaf first
        if not zero:
            return
        self.clock += 1
        cached = [b for b in zero if self.hash_of[b] is not None]
        if cached:
            self.stamp[cached] = self.clock
            self.lru.extend(zip(repeat(self.clock), cached, strict=False))
            self.num_evictable += len(cached)
            if len(self.lru) > 4 * self.num_blocks:
                self._compact_lru()
        if len(cached) < len(zero):
            self.free.extend(b for b in zero if self.hash_of[b] is None)

    def register(
        self, block: int, block_hash: bytes, parent: bytes | None, path: np.ndarray, depth: int
    ) -> int:
        """Give a held block its identity; returns the canonical block for the hash.

        ``path[: depth + 1]`` must be the canonical blocks of the prefix ending at this block.

        If another block already carries the hash, that block is canonical and the caller
        swaps it in (deduplication) and releases its own copy.
        """
        canonical = self.index.get(block_hash)
        if canonical is not None:
            return canonical
        if parent is not None and parent not in self.index:
            raise BlockPoolError(f"block {block}: parent hash not cached (prefix closure)")
        self.index[block_hash] = block
        if path[depth] != block:
            raise BlockPoolError(f"block {block}: path entry {depth} is {path[depth]}")
        self.hash_of[block] = block_hash
        self.parent_of[block] = parent
        self.path_of[block] = (path, depth)
        return block

    def clear_cache(self) -> None:
        """Forget every cached identity (no block may be held): all blocks become free."""
        if self.ref.any():
            raise BlockPoolError("cannot clear the cache while blocks are held")
        for block in [b for b, h in enumerate(self.hash_of) if h is not None]:
            self._uncache(block)
        self.lru.clear()
        self.num_evictable = 0
        self.free = list(range(self.num_blocks - 1, 0, -1))

    def _uncache(self, block: int) -> None:
        h = self.hash_of[block]
        assert h is not None
        del self.index[h]
        self.hash_of[block] = None
        self.parent_of[block] = None
        self.path_of[block] = None
        self.experts.pop(block, None)

    def _compact_lru(self) -> None:
        self.lru = deque((s, b) for s, b in self.lru if self._live(s, b))

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
        for h, b in self.index.items():
            if self.hash_of[b] != h:
                raise BlockPoolError(f"index entry for block {b} disagrees with its identity")
            parent = self.parent_of[b]
            if parent is not None and parent not in self.index:
                raise BlockPoolError(f"block {b} is cached but its parent is not")
            entry = self.path_of[b]
            if entry is None or entry[0][entry[1]] != b:
                raise BlockPoolError(f"block {b}: its prefix path does not end at it")
            if entry[1] and self.index.get(parent or b"") != entry[0][entry[1] - 1]:
                raise BlockPoolError(f"block {b}: its prefix path disagrees with its parent")
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

    def snapshot(self) -> tuple[object, ...]:
        """Everything the pool holds, for whole-state comparisons in tests."""
        live = [(s, b) for s, b in self.lru if self._live(s, b)]
        return (
            self.ref.tobytes(),
            tuple(self.hash_of),
            tuple(self.free),
            tuple(live),
            self.stamp.tobytes(),
            self.clock,
            self.num_evictable,
        )
