"""The eviction strategies (``policy/eviction.py``): what each orders first, the allocation
that evicts for room (``Growth.take_blocks``), and the registries configuration names."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tests.reducers.test_blocks import allocate, cache_chain, chain, release, take
from tests.reducers.test_checkpoints import BS, CachedPaths, make_table, pin, published, unpin

from kvsched.config import EVICTIONS, PLACEMENTS
from kvsched.events import types as ev
from kvsched.policy.eviction import (
    BLOCK_EVICTION,
    CHECKPOINT_EVICTION,
    ENDS,
    INTERIOR,
    FrozenFirst,
    LruBlocks,
    LruCheckpoints,
    OracleEviction,
    ValueEviction,
)
from kvsched.reducers.blocks import BlockPool
from kvsched.reducers.checkpoints import Checkpoint, CheckpointTable
from kvsched.reducers.future import NEVER, FutureUses
from kvsched.statemachines import CkptState

from .helpers import Harness, config, request, tokens


def test_every_configured_checkpoint_eviction_names_a_registered_strategy() -> None:
    assert tuple(CHECKPOINT_EVICTION) == EVICTIONS
    assert set(BLOCK_EVICTION) == {"lru"}
    cfg = config(hybrid=True)
    for key in EVICTIONS:
        ranked = CHECKPOINT_EVICTION[key](cfg).ranked(
            make_table(max_batch=1, budget=2), FutureUses()
        )
        assert list(ranked) == []


def test_an_allocation_evicts_least_recently_released_blocks_leaf_first_by_events_alone():
    pool = BlockPool(6)
    cached = cache_chain(pool, chain([1, 2, 3]))
    release(pool, cached)
    before = pool.snapshot()
    [evicted], blocks = take(pool, 4)
    assert pool.snapshot() == before  # (the eviction is an event, folded by the caller)
    assert isinstance(evicted, ev.BlocksEvicted)
    # 2 free blocks and 2 evicted cached ones, leaf first; the evicted come first.
    assert evicted.blocks.tolist() == cached[::-1][:2].tolist()
    assert blocks.tolist() == [*evicted.blocks.tolist(), 4, 5]
    assert allocate(pool, 4).tolist() == blocks.tolist()


def test_an_allocation_takes_free_blocks_before_evicting_any() -> None:
    pool = BlockPool(8)
    cached = cache_chain(pool, chain([1, 2]))
    release(pool, cached)
    for n in (1, 3, 5):
        evictions, blocks = take(pool, n)
        assert evictions == [] and blocks.tolist() == pool.free_top(n).tolist()
    with pytest.raises(AssertionError, match="not available"):
        take(pool, 8)  # 5 free + 2 cached: 7 available


class _Youngest:
    """A strategy that picks the most recently released blocks (to show allocation uses it)."""

    def victims(self, pool: BlockPool, n: int) -> np.ndarray:
        return np.asarray(list(pool.evictable_blocks())[::-1][:n], dtype=np.int32)


def test_an_allocation_evicts_the_blocks_its_strategy_picks() -> None:
    pool = BlockPool(4)
    old = cache_chain(pool, chain([1]))
    young = cache_chain(pool, chain([2]))
    release(pool, old)
    release(pool, young)
    allocate(pool, 1)  # the one free block
    assert take(pool, 1, LruBlocks())[1].tolist() == old.tolist()
    assert take(pool, 1, _Youngest())[1].tolist() == young.tolist()


def _three() -> tuple[object, ...]:
    table = make_table(max_batch=2, budget=4)
    old = published(table, 16, b"old")
    tail = published(table, 20, b"tail", frozen=9)
    new = published(table, 32, b"new")
    return table, old, tail, new


def test_lru_offers_the_least_recently_used_first_and_never_a_pinned_one() -> None:
    table, old, tail, new = _three()
    lru = LruCheckpoints(config(hybrid=True))
    assert lru.ranked(table) == [(None, old), (None, tail), (None, new)]  # type: ignore[arg-type]
    pin(table, old)  # type: ignore[arg-type]
    assert [c for _, c in lru.ranked(table)] == [tail, new]  # type: ignore[arg-type]
    assert lru.candidate_priority(table, 1, 16, "chunk_end", 1) == float("inf")  # type: ignore[arg-type]


def test_frozen_first_puts_frozen_tails_first_then_least_recently_used() -> None:
    table, old, tail, new = _three()
    frozen = FrozenFirst(config(hybrid=True))
    order = lambda: [c for _, c in frozen.ranked(table)]  # type: ignore[arg-type]  # noqa: E731
    assert order() == [tail, old, new]
    pin(table, old)  # type: ignore[arg-type]
    assert order() == [tail, new]  # pinned: not a candidate
    unpin(table, old)  # type: ignore[arg-type]  # the last unpin makes it the most recent
    assert order() == [tail, new, old]


def test_value_ranks_the_lowest_priority_first_each_with_its_priority() -> None:
    table, old, tail, new = _three()
    value = ValueEviction(config(hybrid=True, checkpoint_eviction="value"))
    ranked = list(value.ranked(table))  # type: ignore[arg-type]
    # Never restored, each costs 1: a deeper step saves more prefill, so it ranks later.
    assert [c for _, c in ranked] == [old, tail, new]
    assert [p for p, _ in ranked] == [value.priority(table, c) for _, c in ranked]  # type: ignore[arg-type]
    assert ranked[0][0] == pytest.approx(value.saved_seconds(16))


def test_oracle_ranks_the_farthest_next_use_first_never_used_ones_before_all() -> None:
    table, old, tail, new = _three()  # producer 7, steps 16, 20 (no later use) and 32
    future = FutureUses()
    arrival = ev.RequestArrived(7, tokens(40, 1), 1, reuse=((16, 20), (32, 12)))
    future.folds()[ev.RequestArrived](arrival)
    for c in (old, tail, new):
        reserved = ev.CheckpointReserved(c.ckpt_id, 7, c.slot, c.step, c.key, c.anchor, 0)  # type: ignore[attr-defined]
        future.folds()[ev.CheckpointReserved](reserved)
    strategy = OracleEviction(config(hybrid=True))
    ranked = strategy.ranked(table, future)  # type: ignore[arg-type]
    assert [c for _, c in ranked] == [tail, old, new]
    assert [p for p, _ in ranked] == [-float(NEVER), -20.0, -12.0]
    with pytest.raises(TypeError, match="recorded future"):
        strategy.ranked(table)  # type: ignore[arg-type]


def test_the_configured_strategy_chooses_which_checkpoint_kv_pressure_evicts() -> None:
    """Same workload, two strategies: frozen_first evicts the frozen tail, lru the oldest."""
    evicted: dict[str, list[int]] = {}
    for key in ("frozen_first", "lru"):
        h = Harness(
            hybrid=True,
            num_blocks=16,
            max_prefill_tokens=256,
            checkpoint_budget=8,
            checkpoint_placement=("prompt_end",),
            checkpoint_eviction=key,
        )
        for seq_id, n in ((0, 32), (1, 40), (2, 32)):  # the second leaves a frozen tail
            h.step([request(seq_id, tokens(n, seed=11 + seq_id), max_tokens=1)])
            h.run_until_idle()
        by_ckpt = {c.ckpt_id: c.seq_id for c in h.state.ckpts.checkpoints()}
        result = h.step([request(3, tokens(144, seed=14), max_tokens=20)])
        evicted[key] = [
            by_ckpt[d.ckpt_id] for d in result.decisions if isinstance(d, ev.CheckpointEvicted)
        ]
    assert evicted == {"frozen_first": [1], "lru": [0]}


# ------------------------------------------ value: the vectorised order against a rescan


def _oracle_ranked(value: ValueEviction, table: CheckpointTable) -> list[tuple[float, int]]:
    """The full rescan ``ValueEviction.ranked`` was before it read the table's columns (kept
    here as the oracle): every published checkpoint's priority from its record, the deepest
    step of each producer's rule groups from every live checkpoint, sorted by (priority,
    stamp)."""
    deeper_of = {"chunk_end": INTERIOR, "interval": INTERIOR, "prompt_end": ENDS}
    groups_of = {k: tuple(g for g in (INTERIOR, ENDS) if k in g) for k in INTERIOR | ENDS}
    deepest: dict[tuple[int, frozenset[str]], int] = {}
    for c in table.checkpoints():
        for group in groups_of.get(c.kind, ()):
            if c.step > deepest.get((c.seq_id, group), -1):
                deepest[(c.seq_id, group)] = c.step
    weights = value.weights(table)
    out: list[tuple[float, int, Checkpoint]] = []
    for c in table.checkpoints():
        if c.state != CkptState.PUBLISHED:
            continue
        deeper = deeper_of.get(c.kind)
        if deeper is not None and deepest.get((c.seq_id, deeper), -1) > c.step:
            out.append((c.floor, c.stamp, c))
            continue
        worth = value.worth(c.kind, c.step, c.hits, c.cost)
        out.append((c.floor + weights.get(c.kind, 1.0) * worth, c.stamp, c))
    return [(p, c.ckpt_id) for p, _, c in sorted(out, key=lambda item: (item[0], item[1]))]


# (the rules value eviction can see: "oracle" placement runs only with oracle eviction)
VALUE_RULES = tuple(p for p in PLACEMENTS if p != "oracle")


class _Driver:
    """Random checkpoint events on one table: reserve (random producer, rule, depth; some
    frozen tails), publish or abandon, pin and unpin (hits), release, and evict (the value
    order's first victim, or another, with its priority: the floor rises)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.table = CheckpointTable(2, 12, BS, CachedPaths(), 16, (1, 2))  # type: ignore[arg-type]
        self.value = ValueEviction(config(hybrid=True, checkpoint_eviction="value"))
        self.pins: dict[int, int] = {}
        self.keys = 0

    def fold(self, event: ev.Event) -> None:
        self.table.folds()[type(event)](event)

    def in_state(self, state: CkptState) -> list[Checkpoint]:
        return [c for c in self.table.checkpoints() if c.state == state]

    def reserve(self) -> None:
        t, rng = self.table, self.rng
        step = rng.choice([BS, 2 * BS, 3 * BS, 5 * BS, 2 * BS + 3, 4 * BS + 5])
        frozen = 90 + self.keys if step % BS else 0
        if not t.peek_slot() or t.cost_of(bool(frozen)) > t.room():
            return
        self.keys += 1
        kind = rng.choice(VALUE_RULES)
        depth = step // BS
        anchor = bytes([depth]) * 16
        t._pool.add(anchor, np.arange(1, 1 + depth, dtype=np.int32))  # type: ignore[attr-defined]
        self.fold(
            ev.CheckpointReserved(
                t.next_id, rng.randrange(4), t.peek_slot(), step, self.keys.to_bytes(4, "big"),
                anchor, frozen, kind,
            )
        )  # fmt: skip

    def step(self) -> None:
        """A step runs: what it reserved is published or abandoned."""
        self.fold(ev.StepStarted(0, 0.0))
        for ckpt_id in self.table.awaiting_ids():
            if self.rng.random() < 0.8:
                self.fold(ev.CheckpointPublished(ckpt_id))
            else:
                self.fold(ev.CheckpointAbandoned(ckpt_id, "test"))

    def act(self) -> None:
        rng, published = self.rng, self.in_state(CkptState.PUBLISHED)
        op = rng.choice(["reserve", "reserve", "step", "pin", "unpin", "release", "evict"])
        pinned = self.in_state(CkptState.PINNED)
        if op == "reserve":
            self.reserve()
        elif op == "step":
            self.step()
        elif op == "pin" and published + pinned:
            c = rng.choice(published + pinned)
            self.fold(ev.CheckpointPinned(c.ckpt_id, 7))
            self.pins[c.ckpt_id] = self.pins.get(c.ckpt_id, 0) + 1
        elif op == "unpin" and pinned:
            c = rng.choice(pinned)
            self.fold(ev.CheckpointUnpinned(c.ckpt_id, 7))
            self.pins[c.ckpt_id] -= 1
            if not self.pins[c.ckpt_id]:
                del self.pins[c.ckpt_id]
        elif op == "release" and published:
            self.fold(ev.CheckpointReleased(rng.choice(published).ckpt_id, "test"))
        elif op == "evict" and published:
            ranked = list(self.value.ranked(self.table))
            priority, victim = ranked[0] if rng.random() < 0.7 else rng.choice(ranked)
            self.fold(ev.CheckpointEvicted(victim.ckpt_id, priority))


@pytest.mark.parametrize("seed", range(12))
def test_the_value_order_read_off_the_columns_equals_a_full_rescan_bit_for_bit(seed: int):
    """Same victims in the same order, each priority the same float (ties by stamp), after
    every fold of a random sequence of checkpoint events."""
    d = _Driver(seed)
    for _ in range(400):
        d.act()
        got = [(p, c.ckpt_id) for p, c in d.value.ranked(d.table)]
        want = _oracle_ranked(d.value, d.table)
        assert [(float(p).hex(), i) for p, i in got] == [(p.hex(), i) for p, i in want]  # type: ignore[arg-type]
        assert d.table.check_invariants(d.pins) is None


def test_the_random_drive_reaches_ties_redundancy_weights_and_a_rising_floor():
    """(The drive above exercises what the order depends on.)"""
    d = _Driver(3)
    ties = redundant = 0
    for _ in range(400):
        d.act()
        ranked = _oracle_ranked(d.value, d.table)
        prios = [p for p, _ in ranked]
        ties += len(prios) - len(set(prios))
        redundant += sum(
            p == d.table.get(i).floor and d.table.get(i).kind in INTERIOR for p, i in ranked
        )
    assert ties and redundant and d.table.floor > 0
    assert any(w != 1.0 for w in d.value.weights(d.table).values())
