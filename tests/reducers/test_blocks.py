"""BlockPool behaviour: reference counts, free stack, prefix index and leaf-first LRU reuse."""

from __future__ import annotations

from hashlib import blake2b
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.identity import HashChain
from kvsched.policy.eviction import BlockEviction
from kvsched.policy.growth import Growth
from kvsched.reducers.blocks import NULL_BLOCK, BlockPool, BlockPoolError
from kvsched.reducers.errors import RefChange, ReplayMismatch

ROOT = b"root" * 4


def chain(contents: list[int], parent: bytes = ROOT) -> list[bytes]:
    """A hash chain: block i's hash depends on every block content before it."""
    out = []
    for c in contents:
        parent = blake2b(parent + bytes([c]), digest_size=16).digest()
        out.append(parent)
    return out


def arr(*blocks: int) -> np.ndarray:
    return np.asarray(blocks, dtype=np.int32)


def linear_prefix_len(pool: BlockPool, hashes: list[bytes], limit: int) -> int:
    n = 0
    for h in hashes[: max(0, limit)]:
        if h not in pool.index:
            break
        n += 1
    return n


def fold(pool: BlockPool, event: ev.Event) -> None:
    """Fold one of the pool's own events, as EngineState does."""
    change = pool.folds()[type(event)](event)
    if change is not None:
        pool.apply(change)


def attach(pool: BlockPool, blocks: np.ndarray) -> None:
    """One reference more on each block, as a holder's fold hands it to the pool."""
    pool.apply(RefChange(attach=(blocks,)))


def release(pool: BlockPool, blocks: np.ndarray) -> None:
    """One reference less on each block (root first), as a holder's fold hands it over."""
    pool.apply(RefChange(release=(blocks,)))


def take(
    pool: BlockPool, n: int, strategy: BlockEviction | None = None
) -> tuple[list[ev.Event], np.ndarray]:
    """The evictions the policy's allocation of ``n`` blocks emits (not folded) and the
    blocks it takes (``Growth.take_blocks``, with the strategy given, default LRU)."""
    growth = Growth(SchedulerConfig())
    if strategy is not None:
        growth.block_eviction = strategy
    emitted: list[ev.Event] = []
    blocks = growth.take_blocks(SimpleNamespace(pool=pool), n, emitted.append)  # type: ignore[arg-type]
    return emitted, blocks


def allocate(pool: BlockPool, n: int) -> np.ndarray:
    """Allocate ``n`` blocks the way the policy does: evictions first, then the allocation."""
    if n > pool.num_available:
        raise BlockPoolError(f"cannot allocate {n} blocks: {pool.num_available} available")
    evictions, blocks = take(pool, n)
    for e in evictions:
        fold(pool, e)
    fold(pool, ev.BlocksAllocated(np.zeros(1, np.int64), np.asarray([n], np.int32), blocks))
    return blocks


def register(pool: BlockPool, hashes: list[bytes], i: int, block: int) -> int:
    """Cache block ``i`` of a chain (held as ``block``); returns the canonical block (another
    one when the hash is already cached: a deduplication)."""
    canonical = pool.index.get(hashes[i])
    replaced = 0 if canonical is None else block
    canonical = block if canonical is None else canonical
    parent = hashes[i - 1] if i else ROOT
    fold(
        pool,
        ev.BlocksCached(
            np.zeros(1, np.int64), arr(1), arr(i), arr(canonical), arr(replaced), hashes[i], parent
        ),
    )
    return canonical


def cache_chain(pool: BlockPool, hashes: list[bytes]) -> np.ndarray:
    """Allocate and register a chain, leaving it held (root first)."""
    blocks = allocate(pool, len(hashes))
    for i, b in enumerate(blocks.tolist()):
        assert register(pool, hashes, i, b) == b
    return blocks


# ----------------------------------------------------------------------- unit tests


def test_a_fresh_pool_hands_out_blocks_from_one_upwards_and_never_the_null_block():
    pool = BlockPool(5)
    assert pool.num_available == 4
    assert allocate(pool, 4).tolist() == [1, 2, 3, 4]
    assert pool.ref[NULL_BLOCK] == 0
    assert pool.num_available == 0
    pool.check_invariants([arr(1, 2, 3, 4)])


def test_an_allocation_larger_than_what_is_available_fails_and_changes_nothing():
    pool = BlockPool(4)
    held = allocate(pool, 2)
    before = pool.snapshot()
    with pytest.raises(BlockPoolError):
        allocate(pool, 2)
    with pytest.raises(AssertionError, match="not available"):
        take(pool, 2)
    assert pool.snapshot() == before
    pool.check_invariants([held])


def test_releasing_an_unreferenced_block_is_an_error():
    pool = BlockPool(4)
    allocate(pool, 1)
    release(pool, arr(1))
    with pytest.raises(ReplayMismatch):
        release(pool, arr(1))


def test_released_private_blocks_return_to_the_free_stack_and_are_reused_root_first():
    pool = BlockPool(8)
    blocks = allocate(pool, 3)  # 1, 2, 3
    release(pool, blocks)
    assert pool.num_evictable == 0
    # Released leaf first onto the stack, so the root-most block is on top again.
    assert allocate(pool, 3).tolist() == [1, 2, 3]


def test_registering_a_block_whose_parent_is_not_cached_breaks_prefix_closure_and_is_refused():
    pool = BlockPool(4)
    [a, b] = allocate(pool, 2).tolist()
    h = chain([1, 2])
    with pytest.raises(ReplayMismatch):
        register(pool, h, 1, b)
    assert pool.index == {}
    assert register(pool, h, 0, a) == a
    assert register(pool, h, 1, b) == b
    assert pool.cached_prefix(HashChain(b"".join(h)), 2).tolist() == [a, b]


def test_registering_a_hash_that_is_already_cached_returns_the_canonical_block():
    pool = BlockPool(4)
    h = chain([7])
    first = cache_chain(pool, h)
    copy = allocate(pool, 1)
    assert register(pool, h, 0, int(copy[0])) == int(first[0])
    assert pool.hash_of[int(copy[0])] is None
    pool.check_invariants([first, copy])


def test_evictable_blocks_offers_released_cached_blocks_leaf_first_and_changes_nothing():
    pool = BlockPool(8)
    first = cache_chain(pool, chain([1, 2, 3]))
    other = cache_chain(pool, chain([9]))
    release(pool, first)
    release(pool, other)
    before = pool.snapshot()
    assert list(pool.evictable_blocks()) == [*first[::-1].tolist(), *other.tolist()]
    assert pool.snapshot() == before
    attach(pool, first[:1])  # held again: no longer a candidate
    assert list(pool.evictable_blocks()) == [*first[:0:-1].tolist(), *other.tolist()]
    release(pool, first[:1])  # re-released: the most recently released
    assert list(pool.evictable_blocks())[-1] == int(first[0])
    pool.check_invariants([])


def test_free_top_names_the_blocks_an_allocation_takes_in_order():
    pool = BlockPool(6)
    assert pool.free_top(3).tolist() == [1, 2, 3]
    assert pool.free_top(0).tolist() == []
    assert allocate(pool, 2).tolist() == [1, 2]
    assert pool.free_top(3).tolist() == [3, 4, 5]


def test_a_released_cached_chain_is_evicted_leaf_first_and_the_index_stays_prefix_closed():
    pool = BlockPool(4)
    hashes = chain([1, 2, 3])
    blocks = cache_chain(pool, hashes)
    release(pool, blocks)
    assert pool.num_available == 3
    assert len(pool.cached_prefix(HashChain(b"".join(hashes)), 3)) == 3
    for remaining in (2, 1, 0):
        [taken] = allocate(pool, 1).tolist()
        assert taken == int(blocks[remaining])  # the leaf goes first
        assert len(pool.cached_prefix(HashChain(b"".join(hashes)), 3)) == remaining
        pool.check_invariants([arr(*blocks[remaining:].tolist())])
        for h in pool.index:
            parent = pool.parent_of[pool.index[h]]
            assert parent == ROOT or parent in pool.index


def test_the_least_recently_released_chain_is_evicted_before_a_newer_one():
    pool = BlockPool(5)
    old, new = chain([1, 1]), chain([2, 2])
    old_blocks, new_blocks = cache_chain(pool, old), cache_chain(pool, new)
    release(pool, old_blocks)
    release(pool, new_blocks)
    assert allocate(pool, 2).tolist() == old_blocks[::-1].tolist()
    assert len(pool.cached_prefix(HashChain(b"".join(old)), 2)) == 0
    assert len(pool.cached_prefix(HashChain(b"".join(new)), 2)) == 2


def test_attaching_a_cached_block_takes_it_off_the_lru_and_a_second_release_requeues_it():
    pool = BlockPool(4)
    hashes = chain([5, 6])
    blocks = cache_chain(pool, hashes)
    release(pool, blocks)
    assert pool.num_evictable == 2
    hit = pool.cached_prefix(HashChain(b"".join(hashes)), 1)
    assert pool.count_unheld(hit) == 1
    attach(pool, hit)
    assert pool.num_evictable == 1
    assert pool.count_unheld(hit) == 0
    pool.check_invariants([hit])
    # Only the child is evictable; it goes, the attached root stays cached.
    fresh = allocate(pool, 2)
    assert int(blocks[1]) in fresh.tolist() and int(blocks[0]) not in fresh.tolist()
    assert len(pool.cached_prefix(HashChain(b"".join(hashes)), 2)) == 1
    release(pool, hit)
    pool.check_invariants([fresh])
    assert allocate(pool, 1).tolist() == [int(blocks[0])]


def test_a_parent_released_after_its_child_is_evicted_after_the_child():
    pool = BlockPool(4)
    hashes = chain([1, 2])
    blocks = cache_chain(pool, hashes)
    root = blocks[:1].copy()
    attach(pool, root)  # a second holder shares only the root
    release(pool, blocks)  # the child reaches zero first
    release(pool, root)
    order = allocate(pool, 3).tolist()
    assert order.index(int(blocks[1])) < order.index(int(blocks[0]))


def test_cached_prefix_respects_the_limit_and_an_empty_chain():
    pool = BlockPool(8)
    hashes = chain([1, 2, 3, 4])
    cache_chain(pool, hashes)
    assert len(pool.cached_prefix(HashChain(b"".join(hashes)), 0)) == 0
    assert len(pool.cached_prefix(HashChain(b"".join(hashes)), 2)) == 2
    assert len(pool.cached_prefix(HashChain(b"".join(hashes)), 10)) == 4
    assert len(pool.cached_prefix(HashChain(b"".join(chain([1, 2, 9]))), 3)) == 2
    assert len(pool.cached_prefix(HashChain(b"".join(chain([9]))), 1)) == 0
    assert len(pool.cached_prefix(HashChain(), 3)) == 0


def test_check_invariants_detects_a_holder_the_pool_does_not_count():
    pool = BlockPool(4)
    held = allocate(pool, 2)
    with pytest.raises(BlockPoolError):
        pool.check_invariants([held, held[:1]])
    with pytest.raises(BlockPoolError):
        pool.check_invariants([])
    pool.check_invariants([held])


def test_the_lru_queue_stays_bounded_under_repeated_attach_and_release():
    pool = BlockPool(4)
    hashes = chain([3])
    block = cache_chain(pool, hashes)
    release(pool, block)
    for _ in range(100):
        attach(pool, block)
        release(pool, block)
    assert len(pool.lru) <= 4 * pool.num_blocks + 1
    pool.check_invariants([])
    assert pool.num_evictable == 1


# ------------------------------------------------------------------- state machine

CONTENT = st.lists(st.integers(0, 2), min_size=1, max_size=4)


class BlockPoolMachine(RuleBasedStateMachine):
    """BlockPool against a plain model of its references, free stack and LRU order.

    Holders mimic sequences: each holds a chain of blocks (root first), attaches the cached
    prefix of its content, allocates the rest, and registers its blocks root first.
    """

    holders = Bundle("holders")

    @initialize(num_blocks=st.integers(3, 10))
    def setup(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.live: dict[int, dict] = {}
        self.next_id = 0
        self.chains: list[list[bytes]] = []
        # The model.
        self.ref = [0] * num_blocks
        self.ident: dict[int, bytes] = {}
        self.free = list(range(num_blocks - 1, 0, -1))
        self.lru: list[int] = []

    # ------------------------------------------------------------------- model ops

    def _model_allocate(self, n: int) -> list[int]:
        """Evicted cached blocks (least recently released first), then free ones."""
        take = min(n, len(self.free))
        fresh = self.free[len(self.free) - take :][::-1]
        del self.free[len(self.free) - take :]
        evicted = self.lru[: n - take]
        del self.lru[: n - take]
        for b in evicted:
            del self.ident[b]
        out = evicted + fresh
        for b in out:
            self.ref[b] = 1
        return out

    def _model_attach(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.lru.remove(b)
            self.ref[b] += 1

    def _model_release(self, blocks: list[int]) -> None:
        zero = []
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                zero.append(b)
        for b in reversed(zero):
            (self.lru if b in self.ident else self.free).append(b)

    # ----------------------------------------------------------------------- rules

    @rule(target=holders, content=CONTENT)
    def arrive(self, content: list[int]):
        pool = self.pool
        hashes = chain(content)
        self.chains.append(hashes)
        blocks = pool.cached_prefix(HashChain(b"".join(hashes)), len(hashes))
        hit = len(blocks)
        assert hit == linear_prefix_len(pool, hashes, len(hashes))
        assert [self.ident.get(b) for b in blocks.tolist()] == hashes[:hit]
        need = len(hashes) - hit
        if need > pool.num_available - pool.count_unheld(blocks):
            return None  # does not fit: a tentative match is simply not acted on
        attach(pool, blocks)
        self._model_attach(blocks.tolist())
        before = pool.snapshot()
        _, predicted = take(pool, need)  # (its evictions emitted, not folded: no change)
        assert pool.snapshot() == before
        fresh = allocate(pool, need)
        assert predicted.tolist() == fresh.tolist()
        assert fresh.tolist() == self._model_allocate(need)
        holder_id = self.next_id
        self.next_id += 1
        self.live[holder_id] = {
            "blocks": blocks.tolist() + fresh.tolist(),
            "hashes": hashes,
            "registered": hit,
        }
        return holder_id

    @rule(holder=holders)
    def register_next(self, holder):
        h = self.live.get(holder)
        if h is None or h["registered"] == len(h["blocks"]):
            return
        i = h["registered"]
        block, digest = h["blocks"][i], h["hashes"][i]
        canonical = register(self.pool, h["hashes"], i, block)
        if canonical == block:
            assert digest not in self.ident.values()
            self.ident[block] = digest
        else:
            assert self.ident[canonical] == digest
            if canonical in h["blocks"]:
                # Cannot happen with chained hashes: one chain never repeats a digest.
                raise AssertionError("canonical block already in the holder's table")
            swap = np.asarray([canonical], dtype=np.int32)
            attach(self.pool, swap)
            self._model_attach([canonical])
            release(self.pool, np.asarray([block], dtype=np.int32))
            self._model_release([block])
            h["blocks"][i] = canonical
        h["registered"] = i + 1

    @rule(holder=consumes(holders))
    def release(self, holder):
        h = self.live.pop(holder, None)
        if h is None:
            return
        release(self.pool, np.asarray(h["blocks"], dtype=np.int32))
        self._model_release(h["blocks"])

    @rule(n=st.integers(1, 4))
    def allocate_and_release_private(self, n: int):
        """Pressure: a transient private allocation evicts cached blocks."""
        if n > self.pool.num_available:
            with pytest.raises(BlockPoolError):
                allocate(self.pool, n)
            return
        got = allocate(self.pool, n)
        assert got.tolist() == self._model_allocate(n)
        release(self.pool, got)
        self._model_release(got.tolist())

    @rule(data=st.data())
    def prefix_search_matches_linear_scan(self, data):
        if not self.chains:
            return
        hashes = data.draw(st.sampled_from(self.chains))
        limit = data.draw(st.integers(0, len(hashes) + 1))
        blocks = self.pool.cached_prefix(HashChain(b"".join(hashes)), limit)
        got = len(blocks)
        assert got == linear_prefix_len(self.pool, hashes, limit)
        assert blocks.tolist() == [self.pool.index[h] for h in hashes[:got]]

    # ------------------------------------------------------------------ invariants

    @invariant()
    def pool_agrees_with_holders_and_model(self):
        pool = self.pool
        holders = [np.asarray(h["blocks"], dtype=np.int32) for h in self.live.values()]
        pool.check_invariants(holders)
        assert pool.ref.tolist() == self.ref
        assert pool.free == self.free
        live_lru = [b for s, b in pool.lru if pool._live(s, b)]
        assert live_lru == self.lru
        assert {h: b for b, h in self.ident.items()} == pool.index

    @invariant()
    def index_is_prefix_closed_and_parents_outlive_children(self):
        pool = self.pool
        for b in pool.index.values():
            parent = pool.parent_of[b]
            if parent != ROOT:
                assert parent in pool.index
                assert pool.ref[pool.index[parent]] >= pool.ref[b]
                # An evictable parent is evicted after its child.
                if pool.ref[pool.index[parent]] == 0:
                    assert self.lru.index(b) < self.lru.index(pool.index[parent])


BlockPoolMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockPoolMachine = BlockPoolMachine.TestCase


def test_the_pools_queries_answer_without_handing_out_its_columns():
    pool = BlockPool(8)
    h = chain([1, 2])
    [a] = cache_chain(pool, h[:1]).tolist()
    assert pool.cached_block(h[0]) == a and pool.is_cached(h[0])
    assert pool.cached_block(h[1]) is None and not pool.is_cached(h[1])
    assert not pool.has_experts(a)
    [b] = allocate(pool, 1).tolist()  # held once
    assert not pool.is_unheld(b)
    drops = np.zeros(pool.num_blocks, dtype=np.int64)
    drops[b] = 1
    freed = pool.freed_by(drops)
    assert np.nonzero(freed)[0].tolist() == [b]  # dropping its one reference frees it
    freed[:] = True  # a new array: the pool does not change
    assert not pool.is_unheld(b)
