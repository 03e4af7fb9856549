"""A follower that sees only the event stream rebuilds the engine's cache: the prefix index
(hashes, blocks, parents), the checkpoint index, and each live sequence's state and block
table, step after step, for the demo workloads and a trace replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.connectors import InProcessStore
from kvsched.engine import Engine, StepResult
from kvsched.events import types as ev
from kvsched.events.bus import EventBus
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.replay.demo import external_bridge
from kvsched.replay.driver import run
from kvsched.replay.traces import read_trace
from kvsched.replay.workload import Workload, chat_workload
from kvsched.stream import CacheView, engine_view

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces"
MOONCAKE = TRACE / "mooncake_fast25_synthetic_trace.jsonl"


class Follower:
    """A CacheView fed by the engine's bus, compared with the engine every ``every`` steps."""

    def __init__(self, engine: Engine, every: int = 1) -> None:
        self.view = CacheView()
        self.engine = engine
        self.every = every
        self.compared = 0
        engine.bus = EventBus()
        engine.bus.subscribe(self.view.apply)

    def __call__(self, result: StepResult) -> None:
        if result.step % self.every == 0:
            self.compare()

    def compare(self) -> None:
        rebuilt, actual = self.view.snapshot(), engine_view(self.engine.state)
        for part in ("prefix", "parents", "checkpoints", "seqs"):
            assert rebuilt[part] == actual[part], f"step {self.engine.state.step}: {part} differs"
        self.compared += 1


def follow(engine: Engine, workload: Workload, every: int = 1, **kw: Any) -> Follower:
    follower = Follower(engine, every)
    run(engine, SimulatedExecutor(engine.config.model.vocab_size), workload, on_step=follower, **kw)
    follower.compare()
    return follower


def slots(hybrid: bool) -> dict[str, Any]:
    """24 checkpoint slots for a hybrid model (an attention model takes no checkpoint option)."""
    return {"checkpoint_budget": 24} if hybrid else {}


def demo_config(**overrides: Any) -> SchedulerConfig:
    base: dict[str, Any] = {"num_blocks": 160, "max_batch": 16}  # small: evictions happen
    return SchedulerConfig.from_dict({**base, **overrides})


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_a_follower_of_the_demo_stream_rebuilds_the_cache_after_every_step(hybrid: bool):
    config = demo_config(hybrid=hybrid, **slots(hybrid))
    engine = Engine(config, check_invariants=True)
    follower = follow(engine, chat_workload(sessions=12, turns=3, seed=3))
    view = follower.view.counters
    assert follower.compared > 100
    assert view.blocks_cached > 0 and view.blocks_evicted > 0  # the cache was under pressure
    assert view.hit_tokens == engine.state.stats.hit_tokens > 0
    if hybrid:
        assert view.ckpts_published > 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_a_follower_rebuilds_the_tables_of_mtp_sequences_holding_their_overlap_blocks(
    hybrid: bool,
):
    config = demo_config(hybrid=hybrid, num_speculative_tokens=2, **slots(hybrid))
    engine = Engine(config, check_invariants=True)
    overlaps = 0

    class Counting(Follower):
        def __call__(self, result: StepResult) -> None:
            nonlocal overlaps
            overlaps += sum(
                1 for d in result.decisions if isinstance(d, ev.PrefixMatched) and d.overlap_block
            )
            super().__call__(result)

    follower = Counting(engine)
    run(
        engine,
        SimulatedExecutor(config.model.vocab_size),
        chat_workload(sessions=12, turns=3, seed=3),
        on_step=follower,
    )
    follower.compare()
    assert overlaps > 10 and follower.compared > 100  # private copies beside held blocks


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_a_follower_of_the_external_demo_stream_rebuilds_the_second_engines_cache(hybrid: bool):
    config = demo_config(num_blocks=400, hybrid=hybrid, external_kv=True)
    workload = chat_workload(sessions=8, turns=2, seed=5)
    store = InProcessStore(capacity_bytes=1 << 30)
    for _name in ("A", "B"):  # B: a restarted server, empty cache, same store
        engine = Engine(config, check_invariants=True)
        executor = SimulatedExecutor(config.model.vocab_size)
        follower = Follower(engine)
        external = external_bridge(store, config, executor)
        run(engine, executor, workload, on_step=follower, external=external)
        follower.compare()
    assert follower.view.counters.loads_admitted > 0
    assert engine.state.stats.external_hit_tokens > 0


@pytest.mark.parametrize("prealloc", [0, 128], ids=["no-prealloc", "two-blocks-ahead"])
def test_a_follower_rebuilds_the_cache_through_drains_aborts_and_preemptions(prealloc: int):
    config = demo_config(
        num_blocks=40,
        max_batch=4,
        hybrid=True,
        checkpoint_budget=6,
        decode_prealloc_tokens=prealloc,  # spare blocks taken, and given back under pressure
    )
    engine = Engine(config, check_invariants=True)
    follower = Follower(engine)
    executor = SimulatedExecutor(config.model.vocab_size)
    rng = np.random.default_rng(0)
    shared = rng.integers(1, 1000, 200, dtype=np.int32)
    outcome: list[ev.Event] = []
    for step in range(120):
        inputs = list(outcome)
        if step % 7 == 0:
            tail = rng.integers(1, 1000, int(rng.integers(1, 150)), dtype=np.int32)
            inputs.append(ev.RequestArrived(step, np.concatenate([shared, tail]), 20))
        if step % 11 == 5:
            inputs.append(ev.RequestAborted(step - 5))
        if step in (40, 90):
            inputs.append(ev.DrainRequested())
        if step in (43, 93):
            inputs.append(ev.WakeRequested())
        result = engine.step(inputs, float(step))
        follower(result)
        outcome = [] if result.plan.is_empty else [executor.execute(result.plan)]
    assert engine.state.stats.preemptions > 0 and engine.state.stats.requests_aborted > 0
    assert follower.compared == 120


def _synthetic_mooncake(path: Path, requests: int) -> None:
    """A Mooncake-format trace: requests sharing prefixes of 512-token blocks."""
    rng = np.random.default_rng(7)
    lines = []
    for i in range(requests):
        shared = list(range(int(rng.integers(0, 6))))
        own = [1000 + i * 8 + k for k in range(int(rng.integers(1, 4)))]
        ids = shared + own
        n_in = 512 * len(ids) - int(rng.integers(0, 300))
        lines.append(
            f'{{"timestamp": {i * 40}, "input_length": {n_in}, "output_length": '
            f'{int(rng.integers(1, 40))}, "hash_ids": {ids}}}'
        )
    path.write_text("\n".join(lines) + "\n")


def _replay_trace(path: Path, limit: int, hybrid: bool, num_blocks: int) -> Follower:
    trace = read_trace(path, "mooncake", block_size=64, vocab_size=150_000, limit=limit)
    context = 1 << max(18, (trace.info.max_request_tokens + 1).bit_length())
    config = SchedulerConfig(
        model=ModelSpec(vocab_size=150_000, max_context=context),
        num_blocks=num_blocks,
        hybrid=hybrid,
    )
    engine = Engine(config)
    return follow(engine, trace.workload, every=97)


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_a_follower_of_a_500_request_trace_replay_rebuilds_the_cache(tmp_path: Path, hybrid: bool):
    path = tmp_path / "trace.jsonl"
    _synthetic_mooncake(path, 500)
    follower = _replay_trace(path, 500, hybrid, num_blocks=3000)
    counters = follower.view.counters
    assert counters.finished == 500 and counters.blocks_evicted > 0
    # (A hybrid model hits only at checkpoints; this trace's shared prefixes end mid-prompt.)
    assert counters.ckpts_published > 0 if hybrid else counters.hit_tokens > 0


@pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"the shared Mooncake trace is not at {TRACE}")
def test_a_follower_of_the_first_500_requests_of_the_mooncake_trace_rebuilds_the_cache():
    follower = _replay_trace(MOONCAKE, 500, hybrid=False, num_blocks=20_000)
    assert follower.view.counters.finished == 500
    assert follower.view.counters.blocks_evicted > 0


def test_a_follower_counts_the_stored_checkpoints_and_every_eviction_of_one():
    config = demo_config(hybrid=True, checkpoint_budget=4)  # few slots: checkpoints are evicted
    engine = Engine(config, check_invariants=True)
    evicted: list[int] = []
    follower = Follower(engine, every=10)
    engine.bus.subscribe(
        lambda e: evicted.append(e.ckpt_id) if isinstance(e, ev.CheckpointEvicted) else None
    )
    workload = chat_workload(sessions=12, turns=3, seed=3)
    run(engine, SimulatedExecutor(config.model.vocab_size), workload, on_step=follower)
    summary = follower.view.summary()

    assert summary["ckpts_evicted"] == len(evicted) > 0
    assert summary["checkpoints"] == len(engine.state.ckpts.index) > 0
