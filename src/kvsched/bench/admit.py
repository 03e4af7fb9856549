"""``kvsched bench admit``: one whole ``Engine.step`` in which B cached requests arrive and are
admitted with their hits, on lmdeploy's "aligned exact hit" workload (``bench match``'s).

Where ``bench match`` times the match alone (the block identities were computed at arrival,
outside its scope), this times everything the scheduler does for the same requests, in one
step, as a serving engine runs it: input checks, the arrival folds (the prompt copied into
the sequence, the block identity of its L tokens), the ordering of the waiting queue,
admission (the match, a batch row, the block-table copy, reference counts; ``ssm``: the
checkpoint pinned and restored, a save reserved at the new prompt end), the one-token
prefill chunk of each request and the allocation of its tail block, the plan, and the folds
of every decision. Not in it: an event log or stream (the engine has none), the executor.

Set-up (untimed) is ``bench match``'s: the producers' prefill leaves every prompt's blocks (and
in ``ssm`` its prompt-end checkpoint) cached. Each sample's B consumers have fresh sequence ids;
after the timed step the step's outcome (one sampled token each, ``max_tokens=1``) is fed
back untimed, which finishes them and leaves the cache as it was.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvsched.bench.match import VOCAB, _config, _prefill_producers, check_workload
from kvsched.bench.stats import Sampler, summarize
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor


def run_admit_bench(
    *, mode: str, batch: int, context: int, block_size: int = 64, warmup: int = 2, samples: int = 10
) -> dict[str, Any]:
    sampler = AdmitSampler(mode=mode, batch=batch, context=context, block_size=block_size)
    times = sampler.samples(warmup, samples)
    return {
        "impl": "kvsched",
        "bench": "admit",
        "mode": mode,
        "batch": batch,
        "context": context,
        "block_size": block_size,
        "identity": sampler.engine.config.identity,
        "build_s": round(sampler.build_s, 2),
        **summarize(times),
    }


class AdmitSampler(Sampler):
    """``bench admit`` one sample at a time: the constructor is the untimed set-up, ``run``
    one ``Engine.step`` admitting the B consumers (timed), ``undo`` the untimed step that
    finishes them (after checking their hits), ``sample()`` one of each (milliseconds)."""

    def __init__(self, *, mode: str, batch: int, context: int, block_size: int = 64) -> None:
        check_workload(mode, context, block_size)
        self.mode, self.batch, self.context = mode, batch, context
        t0 = time.perf_counter()
        self.engine, self.queries = admit_setup(mode, batch, context, block_size)
        self.build_s = time.perf_counter() - t0
        self.executor = SimulatedExecutor(VOCAB)
        self.clock = 1.0e6
        self.arrivals: list[list[ev.Event]] = []
        self.results: list[Any] = []
        self._prepare(0)

    def _prepare(self, sample: int) -> None:
        first = 1_000_000 + sample * self.batch
        self.arrivals.append(
            [
                ev.RequestArrived(seq_id=first + i, prompt=q, max_tokens=1)
                for i, q in enumerate(self.queries)
            ]
        )

    def run(self) -> None:
        self.results.append(self.engine.step(self.arrivals[-1], self.clock))

    def undo(self) -> None:
        engine, batch = self.engine, self.batch
        result = self.results.pop()
        _check_hits(result.decisions, batch, self.context, self.mode)
        self.clock += 1.0
        done = engine.step([self.executor.execute(result.plan)], self.clock)
        self.clock += 1.0
        finished = sum(len(d.seq_ids) for d in done.decisions if isinstance(d, ev.SequenceFinished))
        if finished != batch or engine.has_work:
            raise AssertionError(f"expected {batch} consumers to finish, {finished} did")
        self._prepare(len(self.arrivals))


def admit_setup(
    mode: str, batch: int, context: int, block_size: int = 64
) -> tuple[Engine, list[np.ndarray]]:
    """The engine after the producers' prefill, and the consumers' prompts (untimed)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, size=context, dtype=np.int64) for _ in range(batch)]
    # kvsched's own checkpoint policy (what a kvsched user runs), with room for everything
    # the producers save (prompt end and tail, intervals) and the consumers' saves.
    budget = (context // 4096 + 4) * batch + 2
    config = _config(batch, context, block_size, mode == "ssm", budget, policy="kvsched")
    engine = Engine(config)
    _prefill_producers(engine, [p.astype(np.int32) for p in prompts])
    return engine, [np.append(p, 7).astype(np.int32) for p in prompts]


def _check_hits(decisions: tuple[ev.Event, ...], batch: int, context: int, mode: str) -> None:
    """Every consumer was admitted with all L tokens hit (``ssm``: from a checkpoint)."""
    hits = [d for d in decisions if isinstance(d, ev.PrefixMatched)]
    full = sum(1 for d in hits if d.num_tokens == context)
    if full != batch:
        raise AssertionError(f"expected {batch} admissions hitting {context} tokens, got {full}")
    if mode == "ssm":
        pinned = sum(1 for d in decisions if isinstance(d, ev.CheckpointPinned))
        if pinned != batch:
            raise AssertionError(f"expected {batch} checkpoint restores, got {pinned}")
