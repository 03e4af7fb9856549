"""Behaviour of the paged-KV scheduler (attention-only models), step by step."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.identity import HashChain
from kvsched.policy import Policy, PrefillOrder
from kvsched.policy.matching import Matcher
from kvsched.replay.driver import run
from kvsched.replay.workload import Turn, Workload, chat_workload
from kvsched.statemachines import SeqState

from .helpers import (
    VOCAB,
    Harness,
    admitted,
    config,
    matched,
    of_type,
    prefills,
    request,
    state_snapshot,
    tokens,
)


def admission_order(h: Harness, max_steps: int = 50) -> list[int]:
    order: list[int] = []
    for _ in range(max_steps):
        order += admitted(h.step())
        if not h.engine.has_work and not h.outcome:
            break
    return order


def cache_prefix(h: Harness, seq_id: int, prompt: np.ndarray, **kw: object) -> None:
    """Run one request to completion so the full blocks of its prompt become cached."""
    h.step([request(seq_id, prompt, max_tokens=2, **kw)])
    h.run_until_idle()


# ------------------------------------------------------------------------- 1. order


def test_fcfs_admits_in_arrival_order_not_in_id_or_submission_order():
    h = Harness(order="fcfs", max_prefill_tokens=64)
    arrivals = {0: 0.3, 1: 0.1, 2: 0.2, 3: 0.0}
    h.step([request(i, 40, arrival_time=t) for i, t in arrivals.items()], clock=1.0)
    order = [s for r in h.results for s in admitted(r)] + admission_order(h)
    assert order == [3, 1, 2, 0]


def test_priority_order_admits_higher_priority_first_then_earlier_arrival():
    h = Harness(order="priority", max_prefill_tokens=64)
    reqs = [
        request(0, 40, arrival_time=0.0, priority=0),
        request(1, 40, arrival_time=0.1, priority=2),
        request(2, 40, arrival_time=0.2, priority=1),
        request(3, 40, arrival_time=0.05, priority=2),
    ]
    h.step(reqs, clock=0.5)
    order = [s for r in h.results for s in admitted(r)] + admission_order(h)
    assert order == [3, 1, 2, 0]


@pytest.mark.parametrize(
    ("low_arrival", "first"),
    [(0.0, 0), (15.0, 1)],  # waited 20 s = two aging levels; waited 5 s = none
)
def test_a_low_priority_request_overtakes_a_higher_one_after_waiting_aging_s_per_level(
    low_arrival: float, first: int
):
    h = Harness(order="priority", aging_s=10.0, max_prefill_tokens=64)
    low = request(0, 40, arrival_time=low_arrival, priority=0)
    high = request(1, 40, arrival_time=20.0, priority=1)
    result = h.step([high, low], clock=20.0)
    assert admitted(result) == [first]


def test_ttft_admits_short_prompts_smallest_first_and_fills_the_budget_past_a_misfit():
    h = Harness(order="ttft", max_prefill_tokens=128)
    reqs = [request(0, 100, arrival_time=0.0), request(1, 10, arrival_time=0.1)]
    reqs.append(request(2, 50, arrival_time=0.2))
    result = h.step(reqs)
    assert admitted(result) == [1, 2]  # 10 + 50; 100 does not fit, ttft keeps looking
    assert admitted(h.step()) == [0]
    fcfs = Harness(order="fcfs", max_prefill_tokens=128)
    assert admitted(fcfs.step(reqs)) == [0, 1]  # fcfs stops at the first misfit


def test_ttft_order_puts_exactly_one_long_prompt_before_the_short_ones_on_long_first_turns():
    cfg = config(order="ttft", prefill_turns="long_first", max_prefill_tokens=64)
    reqs = [
        request(0, 200, arrival_time=0.0),
        request(1, 130, arrival_time=0.1),
        request(2, 30, arrival_time=0.2),
        request(3, 10, arrival_time=0.3),
    ]
    probe = Harness(cfg)
    for r in reqs:
        probe.state.apply(r)
    ttft = PrefillOrder(cfg, Matcher(cfg))
    order = [s.seq_id for s in ttft.order(probe.state, probe.state.turns.turn)]
    assert order == [1, 3, 2, 0]  # fewest-chunk long first, shorts by size, other longs
    h = Harness(cfg)
    assert admitted(h.step(reqs)) == [1]  # the long one goes first and takes the budget


def test_ttft_a_long_prompt_is_not_starved_by_a_stream_of_shorter_long_prompts():
    def first_admission_of_big(aging_s: float) -> int | None:
        h = Harness(order="ttft", max_prefill_tokens=64, aging_s=aging_s, num_blocks=256)
        big = request(0, 6 * 64, arrival_time=0.0, max_tokens=1)
        next_id = 1
        for step in range(60):
            clock = step * 0.1
            arrivals = [request(next_id, 2 * 64, arrival_time=clock, max_tokens=1)]
            next_id += 1
            if step == 0:
                arrivals.insert(0, big)
            if 0 in admitted(h.step(arrivals, clock=clock)):
                return step
        return None

    assert first_admission_of_big(aging_s=1e9) is None  # without aging it would starve
    assert first_admission_of_big(aging_s=0.5) is not None


# ------------------------------------------------------------------ 2. token budget


def test_prefills_in_a_step_never_exceed_the_token_budget_except_a_lone_first_one():
    rng = np.random.default_rng(7)
    for order in ("fcfs", "priority", "ttft"):
        h = Harness(order=order, max_prefill_tokens=100, num_blocks=256, max_batch=16)
        reqs = [
            request(i, int(n), max_tokens=3, priority=int(rng.integers(0, 3)))
            for i, n in enumerate(rng.integers(5, 300, 30))
        ]
        h.step(reqs)
        h.run_until_idle()
        for r in h.results:
            chunks = prefills(r)
            total = sum(e - s for _, s, e in chunks)
            assert total <= 100 or len(chunks) == 1, (order, chunks)
        assert h.state.stats.requests_finished == 30


def test_the_budget_is_filled_in_order_and_the_first_prefill_is_always_admitted():
    h = Harness(max_prefill_tokens=100)  # chunk_tokens = 96
    result = h.step([request(i, 30) for i in range(4)])
    assert [e - s for _, s, e in prefills(result)] == [30, 30, 30]
    big = Harness(max_prefill_tokens=100)
    result = big.step([request(0, 96), request(1, 5)])
    assert prefills(result) == [(0, 0, 96)]  # the first prefill uses the whole budget


def test_a_second_prefill_that_exactly_fills_the_token_budget_is_admitted_in_the_same_step():
    h = Harness(max_prefill_tokens=64)
    result = h.step([request(0, 40, arrival_time=0.0), request(1, 24, arrival_time=0.1)])
    assert admitted(result) == [0, 1]
    assert prefills(result) == [(0, 0, 40), (1, 0, 24)]  # 40 + 24 == 64


def test_a_second_prefill_one_token_over_the_token_budget_waits_for_the_next_step():
    h = Harness(max_prefill_tokens=64)
    result = h.step([request(0, 40, arrival_time=0.0), request(1, 25, arrival_time=0.1)])
    assert admitted(result) == [0]
    assert prefills(result) == [(0, 0, 40)]  # 40 + 25 == 65 > 64
    assert prefills(h.step()) == [(1, 0, 25)]


# --------------------------------------------------------------------- 3. chunking


def chunk_ends(h: Harness, seq_id: int) -> list[int]:
    return [e for r in h.results for s, _, e in prefills(r) if s == seq_id]


@pytest.mark.parametrize("shared", [100, 140, 20])
def test_a_prompt_longer_than_the_budget_is_chunked_at_the_same_boundaries_with_and_without_a_prefix_hit(  # noqa: E501
    shared: int,
):
    prompt = tokens(300, seed=3)
    cold = Harness(max_prefill_tokens=64)
    cold.step([request(1, prompt)])
    cold.run_until_idle()
    cold_ends = chunk_ends(cold, 1)
    assert cold_ends == [64, 128, 192, 256, 300]

    warm = Harness(max_prefill_tokens=64)
    cache_prefix(warm, 0, prompt[:shared])
    warm.results.clear()
    first = warm.step([request(1, prompt)])
    warm.run_until_idle()
    hit = matched(first)[1].num_tokens
    assert hit == (shared // 16) * 16 > 0
    warm_ends = chunk_ends(warm, 1)
    # The hit skips whole chunks (or the head of the first one); the boundaries are canonical.
    assert warm_ends == [e for e in cold_ends if e > hit]
    assert prefills(first)[0][1] == hit
    assert all(e % warm.config.chunk_tokens == 0 for e in warm_ends[:-1])


# ---------------------------------------------------------------- 4. long-chunk gate


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_at_most_max_long_chunks_per_step_non_final_chunks_are_scheduled_per_step(limit: int):
    system = tokens(48, seed=11)
    h = Harness(max_prefill_tokens=64, max_long_chunks_per_step=limit, num_blocks=128)
    cache_prefix(h, 0, np.concatenate([system, tokens(2, seed=12)]))  # caches 3 blocks
    h.results.clear()
    longs = [request(i, np.concatenate([system, tokens(200, seed=i)])) for i in (1, 2, 3)]
    first = h.step(longs)
    # Each long's first chunk is [48, 64): 16 tokens, all three fit the 64-token budget.
    assert [(s, e) for _, s, e in prefills(first)] == [(48, 64)] * limit
    h.run_until_idle()
    lengths = {r.seq_id: len(r.prompt) for r in longs}
    for r in h.results:
        non_final = [c for c in prefills(r) if c[2] < lengths[c[0]]]
        assert len(non_final) <= limit
    assert h.state.stats.requests_finished == 4


# ------------------------------------------------------------------------ 5. rollback


class SpyPolicy(Policy):
    """Records the full state around every admission attempt."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.attempts: list[tuple[int, str, object, object]] = []
        try_admit = self.admission.try_admit

        def spy(state, seq, budget, emit):
            before = state_snapshot(state)
            verdict = try_admit(state, seq, budget, emit)
            self.attempts.append((seq.seq_id, verdict, before, state_snapshot(state)))
            return verdict

        self.admission.try_admit = spy  # type: ignore[method-assign]


def spy_harness(**overrides: object) -> tuple[Harness, SpyPolicy]:
    h = Harness(**overrides)
    spy = SpyPolicy(h.config)
    h.engine = Engine(h.config, policy=spy, check_invariants=True)
    return h, spy


def test_a_cached_hit_rejected_by_the_token_budget_leaves_the_state_untouched():
    prompt = tokens(100, seed=5)
    h, spy = spy_harness(max_prefill_tokens=64)
    cache_prefix(h, 0, prompt[:50])  # 3 cached blocks
    spy.attempts.clear()
    result = h.step([request(1, 60, arrival_time=0.0), request(2, prompt, arrival_time=1.0)])
    assert admitted(result) == [1]
    [(_, verdict, before, after)] = [a for a in spy.attempts if a[0] == 2]
    assert verdict == "stop"
    assert before == after
    assert 2 not in matched(result)
    assert h.state.seq(2).state == SeqState.WAITING
    # The match was real: next step it is taken.
    assert matched(h.step())[2].num_tokens == 48


def test_a_cached_hit_rejected_for_lack_of_blocks_leaves_the_state_untouched():
    prompt = tokens(100, seed=5)
    # 11 usable blocks: 3 cached by request 0, then a hog holds 7; request 2 needs 4 more.
    h, spy = spy_harness(max_prefill_tokens=128, num_blocks=12)
    cache_prefix(h, 0, prompt[:50])
    pool = h.state.pool
    assert pool.num_evictable == 3
    h.step([request(1, 7 * 16 - 8, max_tokens=50)])
    spy.attempts.clear()
    result = h.step([request(2, prompt, arrival_time=1.0)])
    [(_, verdict, before, after)] = [a for a in spy.attempts if a[0] == 2]
    assert verdict == "stop"
    assert before == after
    assert 2 not in matched(result) and 2 not in admitted(result)
    assert pool.num_evictable == 3  # the tentative hit did not attach (or evict) anything


def test_a_rejected_admission_does_not_release_another_sessions_blocks_in_vain():
    prompt = tokens(100, seed=5)
    h, spy = spy_harness(max_prefill_tokens=128, num_blocks=12)
    # Session 9 holds 2 blocks between turns.
    h.step([request(0, 40, session_id=9, max_tokens=2)])
    h.run_until_idle()
    assert len(h.state.sessions[9].held) == 2
    h.step([request(1, 7 * 16 - 8, max_tokens=50)])  # the hog: 7 blocks
    spy.attempts.clear()
    # Request 2 needs 7 blocks: even with the session's 2 released, only 4 + 2 would be free.
    result = h.step([request(2, prompt)])
    [(_, verdict, before, after)] = [a for a in spy.attempts if a[0] == 2]
    assert verdict == "stop"
    assert before == after
    assert not of_type(result.decisions, ev.BlocksFreed)
    assert len(h.state.sessions[9].held) == 2


# ------------------------------------------------------------------- 6. preemption


@pytest.mark.parametrize(
    ("priorities", "victim"),
    [((1, 0, 0), 2), ((1, 0, 2), 1), ((0, 0, 0), 2)],
)
def test_decode_growth_preempts_the_policy_victim_not_the_sequence_needing_the_block(
    priorities: tuple[int, int, int], victim: int
):
    # 6 usable blocks; three sequences hold 2 each; sequence 0 needs a third at position 32.
    h = Harness(max_prefill_tokens=128, num_blocks=7, max_batch=4)
    sizes = (31, 20, 20)
    reqs = [
        request(i, n, max_tokens=6, arrival_time=float(i), priority=p)
        for i, (n, p) in enumerate(zip(sizes, priorities, strict=True))
    ]
    assert admitted(h.step(reqs)) == [0, 1, 2]
    preempted = []
    for _ in range(3):
        r = h.step()
        preempted += [d.seq_id for d in of_type(r.decisions, ev.SequencePreempted)]
        if preempted:
            break
    assert preempted == [victim]
    assert h.state.seq(victim).state == SeqState.WAITING
    assert victim in h.state.seqs.waiting
    assert h.state.seqs.nblocks[h.state.seq(0).row] == 3
    # On readmission it re-hits its own cached block; not counted as a new query.
    readmit = None
    for _ in range(40):
        r = h.step()
        if victim in admitted(r):
            readmit = matched(r)[victim]
            break
    assert readmit is not None
    assert readmit.num_tokens >= 16
    assert readmit.num_query_tokens == 0
    h.run_until_idle()
    assert h.state.pool.ref.sum() == 0


def test_a_victim_preempted_in_the_middle_of_its_chunked_prefill_is_not_scheduled_that_step():
    # 6 usable blocks. Sequence 0 (priority 1) decodes and needs its third block at position
    # 32 just as low-priority sequence 1 holds 4 blocks half-way through its 90-token prefill.
    h = Harness(order="priority", max_prefill_tokens=64, num_blocks=7, max_batch=4)
    assert admitted(h.step([request(0, 31, max_tokens=4, priority=1)])) == [0]
    second = h.step([request(1, 90, max_tokens=2, priority=0, arrival_time=0.1)])
    assert prefills(second) == [(1, 0, 64)]
    third = h.step()
    preempted = [d.seq_id for d in of_type(third.decisions, ev.SequencePreempted)]
    assert preempted == [1]
    assert all(s != 1 for s, _, _ in prefills(third))
    assert h.state.seq(1).state == SeqState.WAITING
    h.run_until_idle()
    assert h.state.stats.requests_finished == 2
    assert h.state.pool.ref.sum() == 0


# -------------------------------------------------------------------- 7. sessions


def test_a_second_turn_hits_every_full_block_of_the_first_turn_and_the_session_holds_them():
    h = Harness()
    first = request(0, 40, max_tokens=10, session_id=5)
    h.step([first])
    results = h.run_until_idle()
    held_events = [d for r in results for d in of_type(r.decisions, ev.SessionBlocksHeld)]
    assert len(held_events) == 1 and held_events[0].session_id == 5
    session = h.state.sessions[5]
    history = h.state.sessions.history_len(5)
    assert history == 50
    assert len(session.held) == history // 16 == 3
    assert (h.state.pool.ref[session.held] == 1).all()
    h.state.check_invariants()

    second = h.step([request(1, tokens(20, seed=77), max_tokens=3, session_id=5)])
    m = matched(second)[1]
    assert m.num_tokens == (history // 16) * 16
    assert m.blocks.tolist() == held_events[0].blocks.tolist()
    freed = of_type(second.decisions, ev.BlocksFreed)
    assert [f.seq_ids.tolist() for f in freed] == [[-6]]  # the session hand-off
    h.run_until_idle()
    assert len(h.state.sessions[5].held) > 0
    end = h.step([ev.SessionEnded(5)])
    assert of_type(end.decisions, ev.SessionClosed)
    assert 5 not in h.state.sessions
    assert h.state.pool.ref.sum() == 0


def first_idle_session_reclaimed(sessions_by_last_use: list[int]) -> int:
    """Whose held blocks an admission short of blocks releases first, among idle sessions
    listed least recently used first. The order is stated here only: the least recently used
    (``session_reclaim="last_use"``, the default; it was the lowest session id before)."""
    return sessions_by_last_use[0]


def test_an_admission_short_of_blocks_releases_only_the_first_idle_session_hold_in_order():
    h = Harness(max_prefill_tokens=128, num_blocks=12)  # 11 usable blocks
    by_last_use = [5, 3, 7]  # neither id order nor its reverse
    for turn, session_id in enumerate(by_last_use):
        h.step([request(turn, 40, max_tokens=2, session_id=session_id)])
        h.run_until_idle()
    # Each session holds the 2 full blocks of its 42-token history: 5 blocks are free.
    result = h.step([request(10, 90, max_tokens=2)])  # needs 6: one session's hold must go
    assert admitted(result) == [10]
    freed = [s for f in of_type(result.decisions, ev.BlocksFreed) for s in f.seq_ids.tolist()]
    first = first_idle_session_reclaimed(by_last_use)
    assert freed == [-first - 1]  # a session's hold is freed under holder id -session_id - 1
    h.run_until_idle()
    for session_id in by_last_use:  # the others kept theirs: ending them releases 2 blocks
        end = h.step([ev.SessionEnded(session_id)])
        released = [int(f.counts.sum()) for f in of_type(end.decisions, ev.BlocksFreed)]
        assert released == ([] if session_id == first else [2]), session_id


# ----------------------------------------------------------- 8. abort, end, drain


def test_aborting_a_running_request_releases_exactly_its_blocks():
    h = Harness()
    h.step([request(0, 40, max_tokens=50), request(1, 40, max_tokens=50)])
    h.step()
    state = h.state
    own = state.seqs.blocks_of(state.seq(0).row).copy()
    refs = state.pool.ref.copy()
    result = h.step([ev.RequestAborted(0)])
    [freed] = of_type(result.decisions, ev.BlocksFreed)
    assert freed.seq_ids.tolist() == [0]
    assert sorted(freed.blocks.tolist()) == sorted(own.tolist())
    expect = refs.copy()
    expect[own] -= 1
    for alloc in of_type(result.decisions, ev.BlocksAllocated):
        assert 0 not in alloc.seq_ids.tolist()
        expect[alloc.blocks] += 1  # sequence 1's growth this step
    assert (state.pool.ref == expect).all()
    assert 0 not in state.seqs.seqs
    assert state.stats.requests_aborted == 1


def test_aborting_a_waiting_request_releases_nothing_and_keeps_the_rest_intact():
    h = Harness(max_batch=1)
    h.step([request(0, 60, max_tokens=50), request(1, 60, max_tokens=50)])
    h.step()
    assert 1 in h.state.seqs.waiting
    refs = h.state.pool.ref.copy()
    result = h.step([ev.RequestAborted(1)])
    assert not of_type(result.decisions, ev.BlocksFreed)
    assert [d.seq_id for d in of_type(result.decisions, ev.SequenceAborted)] == [1]
    assert 1 not in h.state.seqs.seqs and 1 not in h.state.seqs.waiting
    grown = h.state.pool.ref - refs  # only sequence 0's decode growth, never a release
    assert (grown >= 0).all() and grown.sum() <= 1
    h.run_until_idle()
    assert h.state.stats.requests_finished == 1 and h.state.pool.ref.sum() == 0


def test_ending_a_session_releases_exactly_its_held_blocks():
    h = Harness()
    h.step([request(0, 40, max_tokens=10, session_id=3)])
    h.step([request(1, 70, max_tokens=10, session_id=4)])
    h.run_until_idle()
    held3 = h.state.sessions[3].held.copy()
    held4 = h.state.sessions[4].held.copy()
    refs = h.state.pool.ref.copy()
    result = h.step([ev.SessionEnded(3)])
    [freed] = of_type(result.decisions, ev.BlocksFreed)
    assert freed.seq_ids.tolist() == [-4]
    assert freed.blocks.tolist() == held3.tolist()
    expect = refs.copy()
    expect[held3] -= 1
    assert (h.state.pool.ref == expect).all()
    assert h.state.sessions[4].held.tolist() == held4.tolist()


def test_ending_a_session_with_a_turn_in_flight_aborts_it_and_releases_everything():
    h = Harness()
    h.step([request(0, 40, max_tokens=4, session_id=3)])
    h.run_until_idle()
    h.step([request(1, 30, max_tokens=50, session_id=3)])
    h.step()
    result = h.step([ev.SessionEnded(3)])
    assert of_type(result.decisions, ev.SequenceAborted)
    assert of_type(result.decisions, ev.SessionClosed)
    assert h.state.pool.ref.sum() == 0


def test_drain_leaves_nothing_held_and_admits_nothing_until_woken():
    h = Harness(max_prefill_tokens=64)
    h.step([request(0, 40, max_tokens=20, session_id=1)])
    h.run_until_idle()
    h.step([request(1, 50, max_tokens=20), request(2, 50, max_tokens=20)])
    h.step()
    result = h.step([ev.DrainRequested()])
    assert of_type(result.decisions, ev.Drained)
    assert result.plan.is_empty
    state = h.state
    assert state.pool.ref.sum() == 0
    assert state.seqs.num_running == 0
    assert len(state.sessions[1].held) == 0
    assert set(state.seqs.waiting) == {1, 2}
    state.check_invariants()
    asleep = h.step([request(3, 20, max_tokens=2)])
    assert asleep.plan.is_empty and not admitted(asleep)
    woken = h.step([ev.WakeRequested()])
    assert of_type(woken.decisions, ev.Woken)
    assert admitted(woken)
    h.run_until_idle()
    assert state.stats.requests_finished == 4


# ------------------------------------------------------------- executor failures


def test_a_sequence_in_more_failed_steps_than_max_step_retries_is_aborted_at_the_next_failure():
    retries = 2
    h = Harness(max_step_retries=retries)
    result = h.step([request(0, 40, max_tokens=4)])
    for failure in range(1, retries + 2):
        assert result.plan.seq_ids.tolist() == [0]  # the same work, retried
        h.outcome = [ev.StepFailed(result.plan.step, "device error")]  # not the executor's
        result = h.step()
        aborts = of_type(result.decisions, ev.SequenceAborted)
        if failure <= retries:
            assert not aborts, f"aborted after only {failure} failed steps"
            assert prefills(result) == [(0, 0, 40)]
    [abort] = aborts
    assert abort.seq_id == 0
    assert f"{retries + 1} times" in abort.reason and "device error" in abort.reason
    assert result.plan.is_empty
    assert h.state.stats.requests_aborted == 1


# ------------------------------------------------------------------- 9. no leaks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_block_is_leaked_once_every_request_has_finished_under_preemption_pressure(seed: int):
    cfg = config(num_blocks=24, max_batch=6, max_prefill_tokens=64, max_long_chunks_per_step=1)
    work = chat_workload(
        sessions=6,
        turns=3,
        system_tokens=40,
        user_tokens=(5, 60),
        output_tokens=(5, 60),
        rate_per_s=200.0,
        think_s=0.01,
        vocab_size=VOCAB,
        seed=seed,
    )
    rng = np.random.default_rng(seed)
    extra = tuple(
        Turn(
            request(
                1000 + i,
                int(rng.integers(10, 150)),
                max_tokens=int(rng.integers(1, 40)),
                priority=int(rng.integers(0, 3)),
            ),
            arrival_s=float(rng.uniform(0, 0.05)),
        )
        for i in range(10)
    )
    engine = Engine(cfg, check_invariants=True)
    summary = run(
        engine, SimulatedExecutor(VOCAB), Workload("mix", work.turns + extra), max_steps=5000
    )
    assert summary.finished + summary.rejected == len(work.turns) + len(extra)
    assert summary.preemptions > 0
    state = engine.state
    assert state.seqs.num_running == 0 and not state.seqs.waiting
    assert state.pool.ref.sum() > 0  # sessions hold their history until they end
    engine.step([ev.SessionEnded(s) for s in sorted(state.sessions)], clock=summary.sim_time_s)
    state.check_invariants()
    assert not state.sessions
    assert state.pool.ref.sum() == 0
    assert state.pool.num_available == cfg.num_blocks - 1


# ------------------------------------------------------- 10. hits and isolation


def test_a_prompt_of_exactly_n_cached_full_blocks_hits_n_minus_one_blocks():
    prompt = tokens(64, seed=9)
    h = Harness()
    cache_prefix(h, 0, prompt)
    assert len(h.state.pool.cached_prefix(_hashes(h, prompt), 4)) == 4  # all four are cached
    result = h.step([request(1, prompt)])
    assert matched(result)[1].num_tokens == 48
    assert prefills(result) == [(1, 48, 64)]


def _hashes(h: Harness, prompt: np.ndarray, **kw: object) -> HashChain:
    probe = Harness(h.config)
    probe.state.apply(request(99, prompt, **kw))
    return probe.state.seq(99).hashes


@pytest.mark.parametrize(
    ("kw", "hit"),
    [
        ({}, 48),
        ({"adapter": "lora-a"}, 0),
        ({"cache_salt": "tenant-b"}, 0),
        ({"adapter": "lora-a", "cache_salt": "tenant-b"}, 0),
    ],
)
def test_prefix_hits_are_isolated_by_adapter_and_cache_salt(kw: dict, hit: int):
    prompt = tokens(60, seed=21)
    h = Harness()
    cache_prefix(h, 0, prompt)
    assert matched(h.step([request(1, prompt, **kw)]))[1].num_tokens == hit
    same = Harness()
    cache_prefix(same, 0, prompt, **kw)
    assert matched(same.step([request(1, prompt, **kw)]))[1].num_tokens == 48


@pytest.mark.parametrize(("content", "hit"), [(b"image-a", 48), (b"image-b", 16)])
def test_prefix_hits_depend_on_the_content_hash_of_multimodal_spans(content: bytes, hit: int):
    prompt = tokens(60, seed=22)
    h = Harness()
    cache_prefix(h, 0, prompt, mm_spans=(ev.MultimodalSpan(20, 40, b"image-a"),))
    result = h.step([request(1, prompt, mm_spans=(ev.MultimodalSpan(20, 40, content),))])
    # The span starts in block 1: block 0 is shared whatever the image.
    assert matched(result)[1].num_tokens == hit


# ------------------------------------------------------------------- 11. StepPlan


def check_plan(h: Harness, result) -> None:
    plan, state = result.plan, h.state
    bs = plan.block_size
    t = state.seqs
    pos_parts, slot_parts, id_parts = [], [], []
    for i, seq_id in enumerate(plan.seq_ids.tolist()):
        seq = state.seq(seq_id)
        row = seq.row
        start, end = int(plan.starts[i]), int(plan.ends[i])
        nb = int(plan.num_blocks[i])
        assert nb == -(-end // bs) <= t.nblocks[row]
        assert plan.block_tables[i, :nb].tolist() == t.table[row, :nb].tolist()
        assert not plan.block_tables[i, nb:].any()
        pos = np.arange(start, end)
        pos_parts.append(pos)
        slot_parts.append(plan.block_tables[i, pos // bs].astype(np.int64) * bs + pos % bs)
        t.flush(row)
        id_parts.append(seq.tokens[start:end])
        assert bool(plan.sample[i]) == (end == t.ntokens[row])
    if plan.num_seqs:
        assert plan.positions.tolist() == np.concatenate(pos_parts).tolist()
        assert plan.slot_mapping.tolist() == np.concatenate(slot_parts).tolist()
        assert plan.input_ids.tolist() == np.concatenate(id_parts).tolist()
        assert len(set(plan.slot_mapping.tolist())) == plan.num_tokens
        assert not (plan.slot_mapping < bs).any()  # never the null block
    for name in (
        "seq_ids",
        "starts",
        "ends",
        "positions",
        "slot_mapping",
        "block_tables",
        "input_ids",
        "num_blocks",
        "sample",
    ):
        arr = getattr(plan, name)
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError):
            arr[...] = 0


def test_plans_slot_mapping_positions_and_block_tables_agree_with_the_sequences():
    h = Harness(max_prefill_tokens=64, num_blocks=40, max_batch=5)
    rng = np.random.default_rng(3)
    system = tokens(40, seed=4)
    pending = [
        request(
            i,
            np.concatenate([system, tokens(int(rng.integers(1, 120)), seed=i)]),
            max_tokens=int(rng.integers(1, 30)),
        )
        for i in range(12)
    ]
    checked = 0
    for step in range(400):
        arrivals = pending[:2] if step % 3 == 0 else []
        pending = pending[len(arrivals) :]
        result = h.step(arrivals)
        check_plan(h, result)
        checked += result.plan.num_seqs
        if not pending and not h.engine.has_work and not h.outcome:
            break
    assert h.state.stats.requests_finished == 12
    assert checked > 50


def test_the_plan_counts_the_prefix_hit_tokens_of_the_steps_admissions() -> None:
    from kvsched.config import SchedulerConfig
    from kvsched.engine import Engine
    from kvsched.events import types as ev
    from kvsched.gpu.sim import SimulatedExecutor

    config = SchedulerConfig(block_size=16, num_blocks=64, max_batch=4, max_prefill_tokens=256)
    engine = Engine(config, check_invariants=True)
    executor = SimulatedExecutor(config.model.vocab_size)
    prompt = np.arange(1, 50, dtype=np.int32)
    first = engine.step([ev.RequestArrived(0, prompt, 1)], 0.0)
    assert (first.plan.num_hit_tokens, first.plan.num_query_tokens) == (0, 49)
    done = engine.step([executor.execute(first.plan)], 1.0)
    assert done.plan.is_empty
    second = engine.step([ev.RequestArrived(1, prompt, 1)], 2.0)
    assert (second.plan.num_hit_tokens, second.plan.num_query_tokens) == (48, 49)


def test_a_session_turn_with_another_adapter_does_not_reuse_the_history_identity() -> None:
    h = Harness()
    first = tokens(40, seed=11)
    h.step([request(0, first, max_tokens=2, session_id=7)])
    h.run_until_idle()
    history = h.state.sessions.history[7].tokens.copy()
    h.step([request(1, tokens(10, seed=12), max_tokens=1, session_id=7, adapter="lora-x")])
    seq = h.state.seq(1)
    from kvsched.identity import chain_hashes, namespace_root

    config = h.state.config
    plain = namespace_root(config.model, config.block_size, "lora-x", "", config.identity)

    assert seq.hashes == chain_hashes(plain, seq.token_view(), 16)
    assert len(history) == 42


def test_a_session_keeps_the_multimodal_identity_of_its_history() -> None:
    from kvsched.events.types import MultimodalSpan
    from kvsched.identity import chain_hashes, namespace_root, span_extras

    h = Harness()
    image = MultimodalSpan(30, 40, b"cat-image-digest")  # reaches into the partial block
    first = tokens(40, seed=13)
    h.step([request(0, first, max_tokens=1, session_id=3, mm_spans=(image,))])
    h.run_until_idle()
    h.step([request(1, tokens(30, seed=14), max_tokens=1, session_id=3)])
    seq = h.state.seq(1)
    config = h.state.config
    root = namespace_root(config.model, config.block_size, "", "", config.identity)
    all_tokens = seq.token_view()
    extras = span_extras((image,), 16, 0, len(all_tokens) // 16)
    assert seq.hashes == chain_hashes(root, all_tokens, 16, 0, extras)
    assert seq.hashes != chain_hashes(root, all_tokens, 16)  # the image is part of identity


def test_a_prefix_match_decision_keeps_its_blocks_after_their_cache_path_is_reused() -> None:
    """Events are values: a subscriber that keeps a PrefixMatched sees the blocks it named,
    even after the tip of that cached chain is evicted and a branch reuses its path slot."""
    h = Harness(num_blocks=6, max_prefill_tokens=128)  # 5 usable blocks
    first = tokens(48, seed=11)
    h.step([request(0, first, max_tokens=1)])
    h.run_until_idle()  # blocks 0-2 of `first` cached
    hit = matched(h.step([request(1, np.concatenate([first, tokens(10, seed=12)]), 1)]))[1]
    h.run_until_idle()
    kept = hit.blocks.copy()
    assert len(kept) == 3
    # A branch after block 0 takes 4 new blocks at admission: 2 free ones and the evicted
    # blocks 2 and 1 of the chain; its own blocks then enter the cache in their path slots.
    branch = np.concatenate([first[:16], tokens(52, seed=13)])
    h.step([request(2, branch, max_tokens=1)])
    h.run_until_idle()
    evictions = [e for r in h.results for e in of_type(r.decisions, ev.BlocksEvicted)]
    evicted = [b for e in evictions for b in e.blocks]
    assert set(kept[1:]) <= set(evicted)  # the path slots of the hit's blocks 1 and 2 reused
    assert np.array_equal(hit.blocks, kept)


@pytest.mark.parametrize("admit", [True, False], ids=["kvsched", "as-vllm"])
def test_a_step_that_preempts_admits_waiting_sequences_unless_told_not_to_as_vllm(admit: bool):
    # As above, sequence 0's decode preempts sequence 1. Request 2 (one block) arrives in
    # that step and fits the room the preemption made: kvsched admits it at once; with
    # admit_after_preemption off (vLLM's rule, the adapter's config) nothing is admitted in
    # that step (later, it waits behind sequence 1, which is first in the queue).
    h = Harness(
        order="priority", max_prefill_tokens=64, num_blocks=7, max_batch=4,
        admit_after_preemption=admit,
    )  # fmt: skip
    h.step([request(0, 31, max_tokens=4, priority=1)])
    h.step([request(1, 90, max_tokens=2, priority=0, arrival_time=0.1)])
    third = h.step([request(2, 10, max_tokens=2, priority=0, arrival_time=0.2)])
    assert [d.seq_id for d in of_type(third.decisions, ev.SequencePreempted)] == [1]
    assert admitted(third) == ([2] if admit else [])
    h.run_until_idle()
    assert h.state.stats.requests_finished == 3
