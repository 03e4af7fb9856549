"""External loads, with a row and every prompt block (``whole_prompt``, before schema 4) or
without a row under soft reservations (``soft``): an open-loop burst on the simulated executor.

    PYTHONPATH=src python3 scripts/bench_loads.py [N LOAD_MS MAX_BATCH NUM_BLOCKS]

N requests of 1,024 tokens arrive at once (16-token blocks, 32 new tokens each); the store
holds every prompt's full blocks, answers each lookup at the next step and finishes each load
LOAD_MS simulated milliseconds after it started (an engine with nothing else to do waits for
the next load to end). Prints, for each load admission, the steps, the makespan and the mean
time to first token (simulated seconds), and the mean decode batch. Defaults: 64 50 8 4096.
"""

from __future__ import annotations

import sys

import numpy as np

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor


def run(config: SchedulerConfig, n: int, load_s: float) -> str:
    engine, executor = Engine(config), SimulatedExecutor(config.model.vocab_size)
    rng = np.random.default_rng(0)
    inputs: list[ev.Event] = [
        ev.RequestArrived(i, rng.integers(1, config.model.vocab_size, 1024, dtype=np.int32), 32)
        for i in range(n)
    ]
    clock, steps, outcome = 0.0, 0, []
    lookups: dict[int, int] = {}  # seq id -> blocks the store holds
    loads: dict[int, float] = {}  # seq id -> when its load ends
    first_token: dict[int, float] = {}
    decode_tokens = decode_steps = 0
    while True:
        reports: list[ev.Event] = [ev.KVLookupAnswered(s, k) for s, k in sorted(lookups.items())]
        lookups.clear()
        for s in sorted(s for s, due in loads.items() if due <= clock):
            reports.append(ev.KVLoadFinished(s))
            del loads[s]
        if not (inputs or outcome or reports or engine.has_work):
            break
        steps += 1
        result = engine.step([*outcome, *reports, *inputs], clock)
        inputs, outcome = [], []
        for d in result.decisions:
            if isinstance(d, ev.KVLookupStarted):
                lookups[d.seq_id] = d.num_blocks
            elif isinstance(d, ev.KVLoadStarted):
                loads[d.seq_id] = clock + load_s
        if not result.plan.is_empty:
            executed = executor.execute(result.plan)
            clock += executed.duration_s
            outcome = [executed]
            for s in executed.seq_ids.tolist():
                first_token.setdefault(s, clock)
            if result.plan.num_decode_tokens:
                decode_steps += 1
                decode_tokens += result.plan.num_decode_tokens
        elif loads and not lookups:
            clock = max(clock, min(loads.values()))  # nothing else to do: the next load ends
    assert engine.state.stats.requests_finished == n
    ttft = float(np.mean(list(first_token.values())))
    return (
        f"{config.legacy.load_admission:>12}: {steps} steps, makespan {clock:.3f} s, mean TTFT "
        f"{ttft:.3f} s, decode batch {decode_tokens / max(1, decode_steps):.2f}"
    )


def main(argv: list[str]) -> None:
    n, load_ms, max_batch, num_blocks = (int(x) for x in (argv or ["64", "50", "8", "4096"]))
    base: dict[str, object] = {
        "model": ModelSpec(vocab_size=32000, max_context=8192),
        "block_size": 16,
        "num_blocks": num_blocks,
        "max_batch": max_batch,
        "max_prefill_tokens": 2048,
        "external": {"enabled": True, "role": "decode"},
    }
    print(f"{n} requests, loads of {load_ms} ms, max_batch {max_batch}, {num_blocks} blocks")
    # "whole_prompt" is the load admission before schema 4: only an old log's header sets it
    # (a Legacy field), so both runs are built the way a header is read.
    for admission in ("whole_prompt", "soft"):
        config = SchedulerConfig.from_log_header({**base, "load_admission": admission}, 4)
        print(run(config, n, load_ms / 1000))


if __name__ == "__main__":
    main(sys.argv[1:])
