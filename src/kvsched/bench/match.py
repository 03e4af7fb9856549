"""``kvsched bench match``: prefix matching on lmdeploy's "aligned exact hit" workload.

``--mode ssm`` (hybrid models): each producer's prompt end (step L, block-aligned) publishes a
state checkpoint; a consumer's match finds it on its hash chain, pins it (the checkpoint's
references cover the whole prefix, so no per-block reference update is needed), attaches the
prefix and selects the checkpoint to restore.

Reproduces ../shared/bench/lmdeploy/README.md: block 64; B prompts of L tokens drawn with
``numpy.random.default_rng(0).integers(1, 150000, size=L)`` in order; each prefilled once by a
producer through the engine (simulated executor) and finished, leaving its blocks cached; then
B consumers (the same L tokens plus one) are matched, one call per request, the batch timed
together. Scope of one match: the hash-chain lookup (identity check included: 128-bit chained
digests), reference counts, LRU state, attaching blocks to the request's block table, moving
its computed-token count to L, and hit statistics — through the policy's own ``find_prefix``
and ``attach_prefix`` and the reducers. Matches are undone (untimed) between samples.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from kvsched.bench.stats import Sampler, summarize
from kvsched.config import CHECKPOINT_POLICIES, Checkpoints, ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor

VOCAB = 150_000


def _config(
    batch: int,
    context: int,
    block_size: int,
    hybrid: bool,
    budget: int = 0,
    policy: str = "lmdeploy",
) -> SchedulerConfig:
    per_seq = context // block_size + 2
    return SchedulerConfig(
        hybrid=hybrid,
        # lmdeploy's rules by default: the producers' only states are their prompt ends, the
        # point the consumers hit, as in lmdeploy's aligned exact-hit workload
        checkpoints=(
            Checkpoints(budget=budget or batch + 2, **CHECKPOINT_POLICIES[policy])
            if hybrid
            else Checkpoints()
        ),
        model=ModelSpec(vocab_size=VOCAB, max_context=context + 64),
        block_size=block_size,
        num_blocks=batch * per_seq * 2 + 16,
        max_batch=batch,
        max_prefill_tokens=context + 16,
    )


def _prefill_producers(engine: Engine, prompts: list[np.ndarray]) -> None:
    executor = SimulatedExecutor(VOCAB)
    inputs: list[ev.Event] = [
        ev.RequestArrived(seq_id=i, prompt=p, max_tokens=1) for i, p in enumerate(prompts)
    ]
    step = 0
    while inputs or engine.has_work:
        result = engine.step(inputs, float(step))
        inputs = [] if result.plan.is_empty else [executor.execute(result.plan)]
        step += 1


def checkpoint_metadata_bytes(engine: Engine) -> int:
    """Host memory held by the checkpoints' identity metadata: the records, their identity
    digests, index entries and prefix-path arrays (each distinct buffer counted once)."""
    ckpts = engine.state.ckpts
    total = sys.getsizeof(ckpts.index) + sys.getsizeof(ckpts.ckpts) + sys.getsizeof(ckpts.partials)
    buffers: dict[int, int] = {}
    for c in ckpts.ckpts.values():
        total += sys.getsizeof(c) + sys.getsizeof(c.key) + sys.getsizeof(c.anchor)
        base = c.path.base if c.path.base is not None else c.path
        buffers[id(base)] = base.nbytes
    return total + sum(buffers.values())


def run_match_bench(
    *, mode: str, batch: int, context: int, block_size: int = 64, warmup: int = 2, samples: int = 10
) -> dict[str, Any]:
    sampler = MatchSampler(mode=mode, batch=batch, context=context, block_size=block_size)
    times = sampler.samples(warmup, samples)
    extra: dict[str, Any] = {}
    if mode == "ssm":
        extra["checkpoints"] = len(sampler.engine.state.ckpts.ckpts)
        extra["ckpt_metadata_mib"] = round(checkpoint_metadata_bytes(sampler.engine) / 2**20, 2)
    return {
        "impl": "kvsched",
        "mode": mode,
        "batch": batch,
        "context": context,
        "block_size": block_size,
        "build_s": round(sampler.build_s, 2),
        **summarize(times),
        **extra,
    }


def check_workload(mode: str, context: int, block_size: int) -> None:
    """The aligned exact-hit workload's arguments (ValueError: the CLI's exit 2)."""
    if mode not in ("ar", "ssm"):
        raise ValueError(f"unknown mode {mode!r} (ar or ssm)")
    if context % block_size:
        raise ValueError("aligned workload: context must be a multiple of the block size")


class MatchSampler(Sampler):
    """``bench match`` one sample at a time: the constructor is the untimed set-up (the
    producers' prefill, the consumers' arrival), ``run`` the match of all B consumers (timed),
    ``undo`` the untimed preemption of each after checking its hit, ``sample()`` one of each
    (milliseconds)."""

    def __init__(self, *, mode: str, batch: int, context: int, block_size: int = 64) -> None:
        check_workload(mode, context, block_size)
        self.mode, self.batch, self.context = mode, batch, context
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1, VOCAB, size=context, dtype=np.int64) for _ in range(batch)]
        self.engine = engine = Engine(_config(batch, context, block_size, hybrid=mode == "ssm"))
        t0 = time.perf_counter()
        _prefill_producers(engine, [p.astype(np.int32) for p in prompts])
        self.build_s = time.perf_counter() - t0
        state = engine.state
        self.decisions: list[ev.Event] = []
        self.consumers = []
        for i, p in enumerate(prompts):
            arrived = ev.RequestArrived(
                seq_id=10_000 + i, prompt=np.append(p, 7).astype(np.int32), max_tokens=1
            )
            state.apply(arrived)
            self.consumers.append(state.seq(arrived.seq_id))

    def emit(self, event: ev.Event) -> None:  # what the engine's emit does: fold it, record it
        self.engine.state.apply(event)
        self.decisions.append(event)

    def run(self) -> None:
        state, policy, emit = self.engine.state, self.engine.policy, self.emit
        for seq in self.consumers:
            policy.attach_prefix(state, seq, policy.find_prefix(state, seq), emit)

    def undo(self) -> None:
        state, policy, consumers = self.engine.state, self.engine.policy, self.consumers
        hits = sum(int(state.seqs.computed[s.row] == self.context) for s in consumers)
        if hits != len(consumers):
            raise AssertionError(f"expected {len(consumers)} full hits, got {hits}")
        if self.mode == "ssm" and any(s.pinned_ckpt < 0 for s in consumers):
            raise AssertionError("an ssm match did not restore a checkpoint")
        for seq in consumers:
            policy.preempt(state, seq, self.emit, "bench undo")
        self.decisions.clear()
        state.check_invariants() if self.batch * self.context <= 1 << 22 else None
