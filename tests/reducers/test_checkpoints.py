"""CheckpointTable behaviour: slots, identity index, partial tails, pins, LRU and invariants;
and the folds of the checkpoint events into EngineState (what a plan must carry)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.policy.helpers import preset

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.reducers.checkpoints import Checkpoint, CheckpointTable, partial_key
from kvsched.reducers.errors import RefChange
from kvsched.reducers.state import ReplayMismatch
from kvsched.statemachines import CkptState, IllegalTransition

ANCHOR_A = b"a" * 16
ANCHOR_B = b"b" * 16
BS = 16


def path(*blocks: int) -> np.ndarray:
    return np.asarray(blocks, dtype=np.int32)


class CachedPaths:
    """A stand-in for the block pool: which anchors are cached, with their prefix paths."""

    def __init__(self) -> None:
        self.index: dict[bytes, int] = {}
        self._paths: dict[int, np.ndarray] = {}

    def add(self, anchor: bytes, blocks: np.ndarray) -> None:
        self.index[anchor] = int(blocks[-1])
        self._paths[int(blocks[-1])] = blocks

    def path_to(self, block: int) -> np.ndarray:
        return self._paths[block]


def make_table(max_batch: int, budget: int) -> CheckpointTable:
    return CheckpointTable(max_batch, budget, BS, CachedPaths())  # type: ignore[arg-type]


def fold(table: CheckpointTable, event: ev.Event) -> RefChange | None:
    return table.folds()[type(event)](event)


def anchor_at(depth: int) -> bytes:
    return ANCHOR_A if depth == 1 else bytes([depth]) * 16


def reserve(table: CheckpointTable, step: int, key: bytes, frozen: int = 0) -> Checkpoint:
    """Reserve a checkpoint of sequence 7 after ``step`` tokens (reserved in a step that is
    then executed: it awaits publication)."""
    ckpt_id = table.next_id
    anchor = anchor_at(step // BS)
    fold(table, ev.CheckpointReserved(ckpt_id, 7, table.peek_slot(), step, key, anchor, frozen))
    return table.get(ckpt_id)


def publish(table: CheckpointTable, c: Checkpoint, blocks: np.ndarray | None = None) -> None:
    blocks = path(*range(1, 1 + c.step // BS)) if blocks is None else blocks
    table._pool.add(c.anchor, blocks)  # type: ignore[attr-defined]
    fold(table, ev.StepStarted(0, 0.0))  # the step that reserved it ran
    fold(table, ev.CheckpointPublished(c.ckpt_id))


def published(table: CheckpointTable, step: int, key: bytes, frozen: int = 0) -> Checkpoint:
    c = reserve(table, step, key, frozen=frozen)
    publish(table, c)
    return c


def drop(table: CheckpointTable, c: Checkpoint, how: type[ev.Event]) -> RefChange | None:
    event = how(c.ckpt_id) if how is ev.CheckpointEvicted else how(c.ckpt_id, "test")
    return fold(table, event)


def pin(table: CheckpointTable, c: Checkpoint) -> None:
    fold(table, ev.CheckpointPinned(c.ckpt_id, 7))


def unpin(table: CheckpointTable, c: Checkpoint) -> None:
    fold(table, ev.CheckpointUnpinned(c.ckpt_id, 7))


# ------------------------------------------------------------------- slots and ids


def test_slots_after_the_runtime_rows_are_handed_out_lowest_first_and_reused_on_removal():
    table = make_table(max_batch=2, budget=3)
    assert (table.first_ckpt_slot, table.num_slots) == (3, 6)
    first = reserve(table, 16, b"k1")
    second = reserve(table, 32, b"k2")
    assert (first.slot, second.slot, first.ckpt_id, second.ckpt_id) == (3, 4, 1, 2)
    drop(table, first, ev.CheckpointAbandoned)
    assert table.peek_slot() == 3  # the freed slot is the next one handed out
    third = reserve(table, 48, b"k3")
    assert (third.slot, third.ckpt_id) == (3, 3)  # ids are never reused
    assert table.check_invariants({}) is None


def test_reserving_anything_but_the_next_id_and_the_top_free_slot_is_refused():
    table = make_table(max_batch=1, budget=2)
    with pytest.raises(ReplayMismatch):
        fold(table, ev.CheckpointReserved(2, 0, table.peek_slot(), 16, b"k", ANCHOR_A))
    with pytest.raises(ReplayMismatch):
        fold(table, ev.CheckpointReserved(1, 0, table.peek_slot() + 1, 16, b"k", ANCHOR_A))
    with pytest.raises(ReplayMismatch):  # a non-aligned state needs its frozen tail block
        fold(table, ev.CheckpointReserved(1, 0, table.peek_slot(), 20, b"k", ANCHOR_A))
    reserve(table, 16, b"k1")
    reserve(table, 32, b"k2")
    assert table.peek_slot() == 0  # exhausted: the null slot means "none"
    with pytest.raises(ReplayMismatch):
        fold(table, ev.CheckpointReserved(3, 0, 0, 48, b"k3", ANCHOR_A))


# ------------------------------------------------------------- lifecycle edges


def test_a_reserved_checkpoint_is_invisible_to_lookups_until_published():
    table = make_table(max_batch=1, budget=2)
    c = reserve(table, 20, b"p", frozen=9)
    assert table.find(b"p") is None and table.find_partials(ANCHOR_A) == {}
    assert c not in table.evictable()
    publish(table, c, path(4))
    assert table.find(b"p") is c
    assert table.find_partials(ANCHOR_A) == {20: 1}
    assert c.state == CkptState.PUBLISHED and c.path.tolist() == [4]


def test_abandoning_a_reservation_frees_its_slot_and_it_can_never_be_published():
    table = make_table(max_batch=1, budget=1)
    c = reserve(table, 16, b"k")
    drop(table, c, ev.CheckpointAbandoned)
    assert c.state == CkptState.RELEASED
    assert table.ckpts == {} and table.free_slots == [2] and table.evictions == 0
    with pytest.raises(ReplayMismatch):
        publish(table, c)


def test_a_published_checkpoint_cannot_be_abandoned_only_released_or_evicted():
    table = make_table(max_batch=1, budget=2)
    c = published(table, 16, b"k")
    with pytest.raises(IllegalTransition):
        drop(table, c, ev.CheckpointAbandoned)
    change = drop(table, c, ev.CheckpointReleased)
    assert c.state == CkptState.RELEASED and table.evictions == 0
    assert change is not None and [b.tolist() for b in change.release] == [[1]]
    d = published(table, 16, b"k")
    drop(table, d, ev.CheckpointEvicted)
    assert d.state == CkptState.EVICTED and table.evictions == 1


def test_unpin_with_more_pins_stays_pinned_and_the_last_unpin_publishes_again():
    table = make_table(max_batch=2, budget=1)
    c = published(table, 16, b"k")
    pin(table, c)
    pin(table, c)
    assert (c.state, c.pins, table.restores) == (CkptState.PINNED, 2, 2)
    assert table.check_invariants({c.ckpt_id: 2}) is None
    unpin(table, c)
    assert (c.state, c.pins) == (CkptState.PINNED, 1)
    unpin(table, c)
    assert (c.state, c.pins) == (CkptState.PUBLISHED, 0)
    with pytest.raises(IllegalTransition):
        unpin(table, c)


@pytest.mark.parametrize(
    "event", [ev.CheckpointEvicted, ev.CheckpointReleased, ev.CheckpointAbandoned]
)
def test_a_pinned_checkpoint_can_be_neither_evicted_nor_released(event: type[ev.Event]):
    table = make_table(max_batch=1, budget=2)
    c = published(table, 16, b"k")
    pin(table, c)
    assert c not in table.evictable()
    with pytest.raises(IllegalTransition):
        drop(table, c, event)
    assert table.find(b"k") is c and c.slot not in table.free_slots


def test_a_reserved_checkpoint_cannot_be_pinned():
    table = make_table(max_batch=1, budget=1)
    c = reserve(table, 16, b"k")
    with pytest.raises(IllegalTransition):
        pin(table, c)


# ----------------------------------------------------------------- identity index


def test_removal_drops_the_index_and_partial_tail_entries_in_the_same_operation():
    table = make_table(max_batch=1, budget=3)
    short = published(table, 20, b"p20", frozen=5)
    long = published(table, 25, b"p25", frozen=6)
    assert table.find_partials(ANCHOR_A) == {20: 1, 25: 1}
    drop(table, short, ev.CheckpointEvicted)
    assert table.find(b"p20") is None
    assert table.find_partials(ANCHOR_A) == {25: 1}
    drop(table, long, ev.CheckpointReleased)
    assert table.index == {} and table.partials == {}  # no empty anchor left behind


def test_removing_a_superseded_duplicate_keeps_the_published_entry_of_that_identity():
    table = make_table(max_batch=2, budget=3)
    winner = reserve(table, 20, b"same", frozen=5)
    loser = reserve(table, 20, b"same", frozen=6)
    publish(table, winner, path(1))
    drop(table, loser, ev.CheckpointAbandoned)
    assert table.find(b"same") is winner
    assert table.find_partials(ANCHOR_A) == {20: 1}
    assert table.check_invariants({}) is None


def test_partial_identity_depends_on_the_anchor_and_every_tail_token():
    tail = np.asarray([3, 4, 5], dtype=np.int32)
    key = partial_key(ANCHOR_A, tail)
    assert key == partial_key(ANCHOR_A, tail.astype(np.int64))
    assert key != partial_key(ANCHOR_B, tail)
    assert key != partial_key(ANCHOR_A, np.asarray([3, 4, 6], dtype=np.int32))
    assert key != partial_key(ANCHOR_A, tail[:2])


# ------------------------------------------------------------------ eviction order


def test_evictable_offers_unpinned_published_checkpoints_least_recently_used_first():
    table = make_table(max_batch=2, budget=4)
    old = published(table, 16, b"old")
    tail = published(table, 20, b"tail", frozen=9)
    new = published(table, 32, b"new")
    reserve(table, 48, b"reserved")  # not published: not a candidate
    assert table.evictable() == [old, tail, new]
    pin(table, old)
    assert table.evictable() == [tail, new]  # pinned: not a candidate
    unpin(table, old)  # the last unpin makes it the most recently used
    assert table.evictable() == [tail, new, old]
    assert len(list(table.checkpoints())) == 4  # every live one, reserved included


def test_the_lazy_lru_queue_stays_bounded_under_many_pin_cycles():
    table = make_table(max_batch=1, budget=2)
    c = published(table, 16, b"k")
    for _ in range(500):
        pin(table, c)
        unpin(table, c)
    assert len(table.lru) <= 4 * (len(table.ckpts) + 16)
    assert table.evictable() == [c]


# ---------------------------------------------------------------------- invariants


def test_invariants_catch_pin_counts_that_disagree_with_the_sequences():
    table = make_table(max_batch=1, budget=2)
    c = published(table, 16, b"k")
    pin(table, c)
    assert table.check_invariants({c.ckpt_id: 1}) is None
    assert "pins" in (table.check_invariants({}) or "")
    assert "unknown" in (table.check_invariants({c.ckpt_id: 1, 99: 1}) or "")


def test_invariants_catch_a_slot_owned_twice_or_lost_and_a_stale_index_entry():
    table = make_table(max_batch=1, budget=2)
    c = published(table, 16, b"k")
    table.free_slots.append(c.slot)
    assert "slots" in (table.check_invariants({}) or "")
    table.free_slots.pop()
    table.index[b"ghost"] = 42
    assert "stale" in (table.check_invariants({}) or "")
    del table.index[b"ghost"]
    del table.index[b"k"]
    assert "indexed" in (table.check_invariants({}) or "")


def test_invariants_catch_a_reservation_that_no_step_will_publish():
    table = make_table(max_batch=1, budget=2)
    reserve(table, 16, b"k")
    fold(table, ev.StepStarted(1, 0.0))  # the step that reserved it is out
    assert table.check_invariants({}) is None
    table._saves.awaiting.clear()  # (what the one-step queue did with two steps out)
    assert "reserved by no step" in (table.check_invariants({}) or "")


def test_with_two_steps_out_each_outcome_publishes_only_its_own_steps_saves():
    table = make_table(max_batch=1, budget=3)
    fold(table, ev.StepStarted(5, 0.0))
    first = reserve(table, 16, b"k1")
    fold(table, ev.StepStarted(6, 0.0))  # step 5 launched, step 6 planned while it runs
    second = reserve(table, 32, b"k2")
    fold(table, ev.StepStarted(7, 0.0))  # step 6 launched too: both are out
    assert table.awaiting_ids(5) == [first.ckpt_id]
    assert table.awaiting_ids(6) == [second.ckpt_id]
    assert table.awaiting_ids() == [first.ckpt_id, second.ckpt_id]
    table._pool.add(first.anchor, path(1))  # type: ignore[attr-defined]
    fold(table, ev.CheckpointPublished(first.ckpt_id))  # step 5's outcome lands
    assert table.awaiting_ids(5) == [] and table.awaiting_ids(6) == [second.ckpt_id]
    assert table.check_invariants({}) is None


def test_holders_are_published_paths_and_every_frozen_block_even_while_reserved():
    table = make_table(max_batch=1, budget=3)
    r = reserve(table, 20, b"r", frozen=7)
    c = reserve(table, 32, b"k")
    publish(table, c, path(1, 2))
    assert r.state == CkptState.RESERVED
    held = sorted(np.concatenate(table.holders()).tolist())
    assert held == [1, 2, 7]


# ---------------------------------------------------------- folds into EngineState


def hybrid_config(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = {
        "model": ModelSpec(vocab_size=1000, max_context=1024),
        "block_size": 16,
        "num_blocks": 32,
        "max_batch": 4,
        "max_prefill_tokens": 64,
        "hybrid": True,
        "checkpoint_budget": 4,
        **preset("lmdeploy"),  # (the mechanics of saves tested here)
    }
    base.update(overrides)
    return SchedulerConfig.from_dict(base)


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 1000, n, dtype=np.int32)


def test_the_state_pool_has_a_null_slot_one_runtime_slot_per_row_and_the_budget():
    cfg = hybrid_config(max_batch=4, checkpoint_budget=6)
    engine = Engine(cfg)
    assert cfg.num_state_slots == 11 == engine.state.ckpts.num_slots
    assert engine.state.ckpts.first_ckpt_slot == 5
    assert SchedulerConfig(hybrid=False).num_state_slots == 1
    attention = SchedulerConfig(model=ModelSpec(vocab_size=1000), max_batch=4)
    assert Engine(attention).state.ckpts.num_slots == 1 + 4  # no budget


def test_a_reservation_fold_allocates_the_frozen_block_and_queues_the_copies():
    engine = Engine(hybrid_config(), check_invariants=True)
    result = engine.step([ev.RequestArrived(0, prompt(40), 2)], 0.0)
    (res,) = [d for d in result.decisions if isinstance(d, ev.CheckpointReserved)]
    c = engine.state.ckpts.get(res.ckpt_id)
    assert (c.step, c.state, c.frozen_block) == (40, CkptState.RESERVED, res.frozen_block)
    partial = int(engine.state.seqs.table[0, 2])
    assert result.plan.copy_blocks_after.tolist() == [[partial, res.frozen_block]]
    assert result.plan.state_save.tolist() == [[1, res.slot]]
    assert engine.state.pool.ref[res.frozen_block] == 1  # the checkpoint owns it


def test_folding_a_reservation_that_disagrees_with_the_pool_is_a_replay_mismatch():
    engine = Engine(hybrid_config())
    engine.step([ev.RequestArrived(0, prompt(40), 2)], 0.0)
    state = engine.state
    seq = state.seq(0)
    key, anchor = state.seqs.identity_at(seq, 40)
    assert state.ckpts.find(key) is None
    wrong = int(state.pool.free_top(1)[0]) + 1
    slot = state.ckpts.peek_slot()
    event = ev.CheckpointReserved(state.ckpts.next_id, 0, slot, 40, key, anchor, wrong)
    before = state.pool.snapshot()
    with pytest.raises(ReplayMismatch):
        state.apply(event)
    assert state.pool.snapshot() == before
    other = ev.CheckpointReserved(state.ckpts.next_id, 0, slot, 40, b"x" * 16, anchor, wrong - 1)
    with pytest.raises(ReplayMismatch, match="not the state of"):
        state.apply(other)  # an identity that is not the sequence's state at 40 tokens


def test_publishing_a_second_checkpoint_of_one_identity_is_a_replay_mismatch():
    cfg = hybrid_config(max_prefill_tokens=128)
    engine = Engine(cfg)
    executor = SimulatedExecutor(1000)
    p = prompt(40)
    first = engine.step([ev.RequestArrived(0, p, 3), ev.RequestArrived(1, p, 3)], 0.0)
    (a,) = [d for d in first.decisions if isinstance(d, ev.CheckpointReserved)]
    state = engine.state
    # a second reservation of the same identity, as a faulty policy would emit it
    frozen = int(engine.policy.growth.take_blocks(state, 1, state.apply)[0])
    twin = ev.CheckpointReserved(
        state.ckpts.next_id, 1, state.ckpts.peek_slot(), 40, a.key, a.anchor, frozen, a.kind
    )
    state.apply(twin)
    state.apply(ev.StepStarted(2, 0.1))
    state.apply(executor.execute(first.plan))
    engine.policy.growth.cache_computed(state, state.apply)
    engine.state.apply(ev.CheckpointPublished(a.ckpt_id))
    with pytest.raises(ReplayMismatch):
        engine.state.apply(ev.CheckpointPublished(twin.ckpt_id))


def test_an_unpin_fold_refuses_a_sequence_that_still_holds_its_own_blocks():
    engine = Engine(hybrid_config())
    executor = SimulatedExecutor(1000)
    p = prompt(40)
    result = engine.step([ev.RequestArrived(0, p, 1)], 0.0)
    engine.step([executor.execute(result.plan)], 0.1)  # publish, finish
    result = engine.step([ev.RequestArrived(1, np.concatenate([p, prompt(8, 1)]), 5)], 0.2)
    seq = engine.state.seq(1)
    assert seq.pinned_ckpt >= 0 and engine.state.seqs.nblocks[seq.row] > seq.n_pinned
    with pytest.raises(ReplayMismatch):
        engine.state.apply(ev.CheckpointUnpinned(seq.pinned_ckpt, 1))


def test_the_aging_floor_never_goes_down_when_a_victim_is_worth_less_than_it() -> None:
    """A victim below the floor (redundant since its last touch, or a continuation whose
    weight fell) leaves the floor where it is; the invariant holds the floor monotone."""
    table = make_table(max_batch=1, budget=3)
    high, low = published(table, 16, b"k1"), published(table, 32, b"k2")
    fold(table, ev.CheckpointEvicted(high.ckpt_id, 5.0))
    fold(table, ev.CheckpointEvicted(low.ckpt_id, 3.0))
    assert table.floor == 5.0, "an eviction below the floor lowered it"
    assert table.check_invariants({}) is None
    table.floor = 4.0  # (what a fold that lowered it would leave)
    problem = table.check_invariants({})
    assert problem is not None and "floor went down" in problem


def test_a_lowered_aging_floor_is_still_reported_after_a_later_eviction() -> None:
    """The invariant compares the floor with the highest floor ever folded, not with the
    floor the latest eviction left."""
    table = make_table(max_batch=1, budget=3)
    first, second = published(table, 16, b"k1"), published(table, 32, b"k2")
    fold(table, ev.CheckpointEvicted(first.ckpt_id, 5.0))
    table.floor = 4.0  # (what a fold that lowered it would leave)
    fold(table, ev.CheckpointEvicted(second.ckpt_id, 3.0))
    problem = table.check_invariants({})
    assert problem is not None and "went down to 4.0 from 5.0" in problem


def test_the_awaiting_checkpoints_and_the_per_rule_counts_are_handed_out_read_only():
    table = make_table(max_batch=2, budget=3)
    c = reserve(table, 16, b"k1")
    fold(table, ev.StepStarted(0, 0.0))  # the step that reserved it ran: it awaits publication
    awaiting = table.awaiting_ids()
    assert awaiting == [c.ckpt_id]
    awaiting.clear()  # a copy
    assert table.awaiting_ids() == [c.ckpt_id]
    table._pool.add(c.anchor, path(1))  # type: ignore[attr-defined]
    fold(table, ev.CheckpointPublished(c.ckpt_id))
    saves = table.saves_by_rule()
    assert sum(saves.values()) == 1 and dict(table.restores_by_rule()) == {}
    with pytest.raises(TypeError):
        saves["chunk_end"] = 9  # type: ignore[index]
