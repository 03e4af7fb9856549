"""``kvsched bench step``: one scheduler step with N running decode sequences.

Timed: ``Engine.step`` with the previous step's outcome as input — validating the inputs
(the outcome against the pending work), folding the sampled tokens (appending, hashing
filled blocks), deciding and folding ``BlocksCached`` for the filled blocks, decode growth
(with its evictions, if any), finish checks and admission, the lifecycle checks of every
scheduled row, and building the frozen plan. Not timed: the simulated executor that
produces the outcome. By default no event log and no sink (so no encoding and no plan
digest); with ``event_log`` the engine writes its log (a temporary file, deleted afterwards,
unless ``log_path`` names one), so the timed step also includes ``plan_digest``, the
record's encoding, the append and the flush.

Set-up (untimed): N arrivals at the first step, admitted over at most ``ADMIT_STEPS`` steps
(the prefill budget is raised past the default 8,192 tokens only where N prompts would need
more steps than that), so the set-up takes about ``ADMIT_STEPS`` steps at any N and the
sequences' decode positions are spread evenly over a block: every timed step fills the blocks
of about N / 64 sequences, as with the default budget at N = 1,024. ``max_tokens`` and the
model's ``max_context`` are sized from the number of set-up steps, so no sequence finishes
while timed, and the block tables are only as wide as a sequence grows. The set-up's objects
are frozen for the garbage collector while timing (``time_samples(freeze=True)``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import numpy as np

from kvsched.bench.stats import summarize, time_samples
from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine, create_log
from kvsched.events import types as ev
from kvsched.events.log import EventLog
from kvsched.gpu.sim import SimulatedExecutor

BLOCK_SIZE = 64
DEFAULT_PREFILL_TOKENS = 8192  # the scheduler's default prefill budget
ADMIT_STEPS = 64  # at most this many admission steps: one block of decode positions
MARGIN = 256  # decode tokens to spare beyond the set-up and the timed steps


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prefill_budget(running: int, prompt: int) -> int:
    """The set-up's prefill budget: the default, or whole blocks for ``ceil(running /
    ADMIT_STEPS)`` prompts per step where that is more (never less than one whole prompt,
    so no prompt is chunked)."""
    per_step = _cdiv(running, ADMIT_STEPS)
    tokens = max(DEFAULT_PREFILL_TOKENS, per_step * prompt)
    return min(_cdiv(tokens, BLOCK_SIZE) * BLOCK_SIZE, 1 << 24)


def setup_bound(running: int, prompt: int) -> int:
    """An upper bound on the set-up steps: the admission steps (``prefill_budget`` admits
    ``budget // prompt`` whole prompts per step) and a few to spare."""
    per_step = max(1, prefill_budget(running, prompt) // prompt)
    return _cdiv(running, per_step) + 4


def bench_config(
    running: int, prompt: int, warmup: int, samples: int
) -> tuple[SchedulerConfig, int]:
    """The engine's config and the requests' ``max_tokens``: enough for the set-up steps
    (``setup_bound``), the timed steps and a margin; the context just past that, so the
    block tables are ``running x (context / 64 + 1)`` entries (``MAX_TABLE_ENTRIES``)."""
    bs = BLOCK_SIZE
    max_tokens = setup_bound(running, prompt) + warmup + samples + MARGIN
    context = _cdiv(prompt + max_tokens + 1, bs) * bs  # (never reached: max_tokens ends first)
    config = SchedulerConfig(
        model=ModelSpec(max_context=context),
        block_size=bs,
        num_blocks=running * (context // bs + 1) + 16,
        max_batch=running,
        max_prefill_tokens=prefill_budget(running, prompt),
    )
    return config, max_tokens


def run_step_bench(
    *,
    running: int,
    prompt: int = 512,
    warmup: int = 5,
    samples: int = 200,
    event_log: bool = False,
    log_path: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Time ``Engine.step`` with ``running`` decoding sequences. ``event_log``: the engine
    writes its event log (to ``log_path`` if given and kept, else to a temporary file that
    is deleted); ``progress``: a progress bar of the set-up on stderr."""
    if log_path is not None:
        event_log = True
    bound = setup_bound(running, prompt)
    config, max_tokens = bench_config(running, prompt, warmup, samples)
    with tempfile.TemporaryDirectory(prefix="kvsched-bench-") as tmp:
        log: EventLog | None = None
        if event_log:
            log = create_log(log_path or os.path.join(tmp, "step.kvlog"), config)
        try:
            out = _run(config, running, prompt, max_tokens, bound, warmup, samples, log, progress)
        finally:
            if log is not None:
                log.close()
    return out


def _run(
    config: SchedulerConfig,
    running: int,
    prompt: int,
    max_tokens: int,
    bound: int,
    warmup: int,
    samples: int,
    log: EventLog | None,
    progress: bool,
) -> dict[str, Any]:
    engine = Engine(config, log=log)
    executor = SimulatedExecutor(config.model.vocab_size)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.model.vocab_size, (running, prompt), dtype=np.int32)
    inputs: list[ev.Event] = [
        ev.RequestArrived(seq_id=i, prompt=prompts[i], max_tokens=max_tokens)
        for i in range(running)
    ]
    clock = 0.0
    table = engine.state.seqs
    bar = _progress(bound, running) if progress else None
    steps = 0
    while True:  # until every sequence is decoding
        result = engine.step(inputs, clock)
        inputs = [executor.execute(result.plan)]
        clock += 0.01
        steps += 1
        rows = table.running_rows()
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{len(rows)}/{running} running", refresh=False)
        if len(rows) == running and np.all(table.computed[rows] == table.ntokens[rows] - 1):
            break
        if steps >= bound:
            raise AssertionError(f"the set-up did not reach {running} decoding in {steps} steps")
    if bar is not None:
        bar.close()
    generated = int((table.ntokens[rows] - table.n_prompt[rows]).max())
    if generated + warmup + samples + 1 >= max_tokens:  # (the bound above is exceeded)
        raise AssertionError(f"{generated} tokens generated in the set-up: max_tokens too small")
    box: dict[str, Any] = {"inputs": inputs, "plan": None}
    offset0 = log.offset if log is not None else 0

    def one_step() -> None:
        box["plan"] = engine.step(box["inputs"], clock).plan

    def feed() -> None:
        plan = box["plan"]
        if plan.num_decode_tokens != running:
            raise AssertionError(f"{plan.num_decode_tokens} decodes, expected {running}")
        box["inputs"] = [executor.execute(plan)]

    times = time_samples(one_step, feed, warmup, samples, freeze=True)
    out: dict[str, Any] = {
        "impl": "kvsched",
        "bench": "step",
        "running": running,
        "event_log": log is not None,
        **summarize(times),
        "setup_steps": steps,
    }
    if log is not None:
        out["record_kib"] = round((log.offset - offset0) / (warmup + samples) / 1024, 1)
    return out


def _progress(total: int, running: int) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=f"set-up ({running} sequences)",
        unit="step",
        file=sys.stderr,
        leave=False,
        disable=None,  # (none where stderr is not a terminal)
    )
