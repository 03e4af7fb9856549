"""The worked step of src/kvsched/reducers/README.md, run exactly: the README stays true."""

from __future__ import annotations

import numpy as np

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor


def test_the_readme_worked_step_caches_a_filled_block_and_admits_a_hit():
    cfg = SchedulerConfig(
        model=ModelSpec(vocab_size=1000, max_context=1024),
        block_size=16,
        num_blocks=32,
        max_batch=4,
        max_prefill_tokens=64,
    )
    engine, executor = Engine(cfg, check_invariants=True), SimulatedExecutor(1000)
    rng = np.random.default_rng(0)
    p3 = rng.integers(1, 1000, 20, dtype=np.int32)
    result = engine.step([ev.RequestArrived(3, p3, 40)], 0.0)
    outcome = [executor.execute(result.plan)]
    for step in range(1, 13):
        result = engine.step(outcome, float(step))
        outcome = [executor.execute(result.plan)]
    assert outcome[0].step == 13 and outcome[0].tokens.tolist() == [158]
    p5 = np.concatenate([p3[:16], rng.integers(1, 1000, 24, dtype=np.int32)])
    result = engine.step([ev.RequestArrived(5, p5, 4), *outcome], 13.0)
    assert [type(e).__name__ for e in result.inputs] == ["StepExecuted", "RequestArrived"]
    d = result.decisions
    assert [type(x).__name__ for x in d] == [
        "StepStarted", "BlocksCached", "BlocksAllocated", "DecodeScheduled", "SequenceAdmitted",
        "PrefixMatched", "BlocksAllocated", "PrefillScheduled",
    ]  # fmt: skip
    cached = d[1]
    assert isinstance(cached, ev.BlocksCached)
    assert (cached.seq_ids.tolist(), cached.starts.tolist(), cached.blocks.tolist()) == (
        [3],
        [1],
        [2],
    )
    seq3 = engine.state.seq(3)
    assert cached.hashes == seq3.hashes[1] and cached.parents == seq3.hashes[0]
    assert d[2].blocks.tolist() == [3] and d[6].blocks.tolist() == [4, 5]
    matched = d[5]
    assert isinstance(matched, ev.PrefixMatched)
    assert (matched.blocks.tolist(), matched.num_tokens, matched.num_query_tokens) == ([1], 16, 40)
    plan = result.plan
    assert plan.seq_ids.tolist() == [3, 5]
    assert (plan.starts.tolist(), plan.ends.tolist()) == ([32, 16], [33, 40])
    assert plan.block_tables.tolist() == [[1, 2, 3], [1, 4, 5]]
    assert plan.slot_mapping[:3].tolist() == [48, 64, 65]
