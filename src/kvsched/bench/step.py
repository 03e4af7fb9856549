"""``kvsched bench step``: one scheduler step with N running decode sequences.

Timed: ``Engine.step`` with the previous step's outcome as input — validating the inputs
(the outcome against the pending work), folding the sampled tokens (appending, hashing
filled blocks), deciding and folding ``BlocksCached`` for the filled blocks, decode growth
(with its evictions, if any), finish checks and admission, the lifecycle checks of every
scheduled row, and building the frozen plan. Not timed: the simulated executor that
produces the outcome. No event log, no sink (so no encoding and no plan digest).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvsched.bench.stats import summarize, time_samples
from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor


def run_step_bench(
    *, running: int, prompt: int = 512, warmup: int = 5, samples: int = 200
) -> dict[str, Any]:
    bs = 64
    max_tokens = warmup + samples + 256  # never finishes while timed
    config = SchedulerConfig(
        model=ModelSpec(max_context=1 << 21),
        block_size=bs,
        num_blocks=running * ((prompt + max_tokens) // bs + 2) + 16,
        max_batch=running,
        max_prefill_tokens=max(8192, prompt),
    )
    engine = Engine(config)
    executor = SimulatedExecutor(config.model.vocab_size)
    rng = np.random.default_rng(0)
    inputs: list[ev.Event] = [
        ev.RequestArrived(
            seq_id=i,
            prompt=rng.integers(1, config.model.vocab_size, prompt, dtype=np.int32),
            max_tokens=max_tokens,
        )
        for i in range(running)
    ]
    clock = 0.0
    table = engine.state.seqs
    while True:  # until every sequence is decoding
        result = engine.step(inputs, clock)
        inputs = [executor.execute(result.plan)]
        clock += 0.01
        rows = table.running_rows()
        if len(rows) == running and np.all(table.computed[rows] == table.ntokens[rows] - 1):
            break
    box: dict[str, Any] = {"inputs": inputs, "plan": None}

    def one_step() -> None:
        box["plan"] = engine.step(box["inputs"], clock).plan

    def feed() -> None:
        plan = box["plan"]
        if plan.num_decode_tokens != running:
            raise AssertionError(f"{plan.num_decode_tokens} decodes, expected {running}")
        box["inputs"] = [executor.execute(plan)]

    times = time_samples(one_step, feed, warmup, samples)
    return {"impl": "kvsched", "bench": "step", "running": running, **summarize(times)}
