"""The "oracle" checkpoint rules (an upper reference): saves exactly where a later request's
hit will end, evicts the checkpoint whose next use is farthest, from the recorded future."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.config import CHECKPOINT_POLICIES
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.fingerprint import FingerprintExecutor
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.replay.future import with_future
from kvsched.replay.runs import replay
from kvsched.replay.setup import SetupError
from kvsched.replay.workload import Turn, Workload, chat_workload

from .helpers import Harness, config, matched, of_type, preset, tokens


def oracle(**overrides: object) -> Harness:
    base: dict[str, object] = {"hybrid": True, "checkpoint_budget": 8, **preset("oracle")}
    return Harness(**{**base, **overrides})


def workload(prompts: list[np.ndarray]) -> Workload:
    """Requests 0.. in order, one second apart (each ends before the next arrives)."""
    turns = tuple(
        Turn(ev.RequestArrived(i, p, 1), arrival_s=float(i)) for i, p in enumerate(prompts)
    )
    return Workload("hand-built", turns)


def serve_all(h: Harness, prompts: list[np.ndarray]) -> dict[int, int]:
    """Serve each request of the workload (with its recorded future) to the end, one after
    the other; the tokens each hit."""
    hits: dict[int, int] = {}
    for turn in with_future(workload(prompts), h.config).turns:
        results = [h.step([turn.request]), *h.run_until_idle()]
        for r in results:
            hits.update({s: m.num_tokens for s, m in matched(r).items()})
    return hits


def reserved(h: Harness) -> list[ev.CheckpointReserved]:
    return [d for r in h.results for d in of_type(r.decisions, ev.CheckpointReserved)]


def evicted(h: Harness) -> list[ev.CheckpointEvicted]:
    return [d for r in h.results for d in of_type(r.decisions, ev.CheckpointEvicted)]


def test_the_oracle_saves_exactly_where_a_later_requests_hit_ends() -> None:
    h = oracle()
    doc = tokens(48, seed=1)
    prompts = [
        np.concatenate([doc, tokens(20, seed=2)]),
        np.concatenate([doc[:32], tokens(30, seed=3)]),  # its hit ends at 32
        np.concatenate([doc, tokens(20, seed=4)]),  # at 48
        np.concatenate([doc[:32], tokens(25, seed=5)]),  # at 32
    ]
    hits = serve_all(h, prompts)
    saves = [(r.seq_id, r.num_tokens, r.kind) for r in reserved(h)]
    assert sorted(saves) == [(0, 32, "oracle"), (0, 48, "oracle")]  # nothing else, ever
    assert hits == {0: 0, 1: 32, 2: 48, 3: 32}


def test_a_later_hit_ending_at_a_chunks_end_is_saved_after_that_chunk() -> None:
    h = oracle()  # (64-token chunks)
    doc = tokens(64, seed=1)
    prompts = [np.concatenate([doc, tokens(20, seed=2)]), np.concatenate([doc, tokens(9, seed=3)])]
    hits = serve_all(h, prompts)
    assert [(r.num_tokens, r.phase) for r in reserved(h)] == [(64, "after")]
    assert hits == {0: 0, 1: 64}


def test_the_oracle_evicts_the_checkpoint_whose_next_use_is_farthest() -> None:
    h = oracle(checkpoint_budget=2)
    a, b, c = (tokens(32, seed=s) for s in (1, 2, 3))
    tail = lambda s: tokens(16, seed=100 + s)  # noqa: E731
    prompts = [np.concatenate([p, tail(i)]) for i, p in enumerate([a, b, c, c, a, b])]
    hits = serve_all(h, prompts)
    by_producer = {r.ckpt_id: r.seq_id for r in reserved(h)}
    # Saving C (next used by 3), A (next 4) and B (next 5) held: B goes, not A (LRU's pick).
    assert [by_producer[e.ckpt_id] for e in evicted(h)] == [1]
    assert evicted(h)[0].priority == -5.0
    assert hits == {0: 0, 1: 0, 2: 0, 3: 32, 4: 32, 5: 0}


def test_the_oracle_declines_a_state_used_later_than_every_one_it_would_replace() -> None:
    h = oracle(checkpoint_budget=1)
    a, b = tokens(32, seed=1), tokens(32, seed=2)
    tail = lambda s: tokens(16, seed=100 + s)  # noqa: E731
    prompts = [np.concatenate([p, tail(i)]) for i, p in enumerate([a, b, a, b])]
    hits = serve_all(h, prompts)
    assert [r.seq_id for r in reserved(h)] == [0]  # B (next use 3) is declined for A (2)
    assert not evicted(h)
    assert hits == {0: 0, 1: 0, 2: 32, 3: 0}


def test_the_oracles_hits_restore_states_that_match_their_prefix() -> None:
    h = oracle(checkpoint_budget=2, max_prefill_tokens=48)
    h.executor = FingerprintExecutor(
        h.config.model.vocab_size,
        h.config.num_blocks,
        h.config.block_size,
        h.config.num_state_slots,
    )
    doc = tokens(96, seed=40)
    prompts = [np.concatenate([doc[: 16 * (1 + i % 5)], tokens(9, seed=41 + i)]) for i in range(10)]
    hits = serve_all(h, prompts)
    assert not h.executor.mismatches, h.executor.mismatches[:3]
    assert sum(hits.values()) > 0


def test_the_oracle_hits_at_least_as_much_as_every_online_policy_on_a_seeded_workload() -> None:
    rng = np.random.default_rng(7)
    docs = [tokens(int(rng.integers(2, 6)) * 16, seed=50 + d) for d in range(6)]
    prompts = []
    for i in range(48):
        doc = docs[int(rng.zipf(1.6)) % len(docs)]
        cut = int(rng.integers(1, len(doc) // 16 + 1)) * 16
        prompts.append(np.concatenate([doc[:cut], tokens(int(rng.integers(5, 40)), seed=i)]))
    rates = {}
    for name in CHECKPOINT_POLICIES:
        cfg = config(hybrid=True, num_blocks=512, checkpoint_budget=3, **preset(name))
        engine = Engine(cfg, check_invariants=True)
        result = replay(engine, SimulatedExecutor(cfg.model.vocab_size), workload(prompts))
        rates[name] = result.metrics["token_hit_rate"]
    best_online = max(r for name, r in rates.items() if name != "oracle")
    assert rates["oracle"] >= best_online > 0, rates


def test_the_oracle_refuses_a_run_without_a_traces_future() -> None:
    cfg = config(hybrid=True, **preset("oracle"))
    engine = Engine(cfg)
    with pytest.raises(SetupError, match="'oracle' needs a trace's future"):
        replay(engine, SimulatedExecutor(cfg.model.vocab_size), chat_workload(sessions=2))


def test_a_recorded_future_is_refused_by_rules_that_do_not_read_it() -> None:
    h = Harness(hybrid=True)
    result = h.step([ev.RequestArrived(0, tokens(40, seed=1), 2, reuse=((16, 1),))])
    (rejected,) = of_type(result.decisions, ev.RequestRejected)
    assert "read only by checkpoints.eviction 'oracle'" in rejected.reason


@pytest.mark.parametrize(
    ("reuse", "why"),
    [
        (((20, 1),), "whole blocks of 16"),
        (((32, 1), (16, 2)), "must ascend"),
        (((48, 1),), "inside the request's 40 tokens"),
        (((16, 0),), "a later request than 0"),
    ],
)
def test_a_malformed_recorded_future_is_rejected_naming_the_fault(
    reuse: tuple[tuple[int, int], ...], why: str
) -> None:
    h = oracle()
    result = h.step([ev.RequestArrived(0, tokens(40, seed=1), 2, reuse=reuse)])
    (rejected,) = of_type(result.decisions, ev.RequestRejected)
    assert why in rejected.reason
