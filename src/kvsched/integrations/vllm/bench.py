"""``kvsched bench vllm``: the scheduler's CPU time per step under vLLM's own structures, vLLM's
default scheduler and kvsched's adapter side by side in one process (needs vLLM).

Setup (not timed): a ``VllmConfig`` for a tiny local model (weights never loaded), a
``KVCacheConfig`` of one full-attention group, N requests of 512 prompt tokens (vLLM's
``Request`` with its sha256 block hasher), stepped until all N are decoding. Timed, per step:
``schedule()`` then ``update_from_output()`` with a ``ModelRunnerOutput`` carrying one token
per request — everything each scheduler does for the step, vLLM's block hashing of the new
tokens (``Request.append_output_token_ids``) in both, kvsched's own identity hashing, input
checks, decisions, plan and translation in the adapter's. The two schedulers alternate by
round; quote the ratio of the same round.

The heap, as vLLM's engine core runs it (``heap="engine"``, the default): after set-up the
collector's generations are collected and frozen (``EngineCore.__init__``'s
``freeze_gc_heap``), then steps run back to back with the collector on, so a sample includes
whatever young-generation collections its allocations trigger. ``heap="cold"`` (the method
before 2026-12-06) collects everything before each sample and times it with the collector
off: every sample starts with cold CPU caches, which costs the adapter's numpy-column steps
proportionally more than vLLM's.

``drafts=K`` turns on speculative decoding with K draft tokens, and the model accepts the
first of each decode's (two tokens per row per step). In the synchronous order (ngram) each
request that samples gets K drafts (``update_draft_token_ids``, timed: a scheduler call); in
the asynchronous one (``ngram_gpu``, the drafter vLLM runs under async scheduling) the
scheduler schedules K placeholder drafts per decode and rolls back the rejected ones when the
output comes back, as vLLM's ``AsyncScheduler`` does.

``order="async"`` runs vLLM's asynchronous call order (``EngineCore.step_with_batch_queue``,
a queue of two): vLLM's ``AsyncScheduler`` against the adapter. A sample is then the scheduler
time of the engine iterations it takes to schedule one step with work: one iteration for
vLLM's, two for the adapter (an empty step, then the next one after the last outcome).
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import time
from collections import deque
from typing import Any

import numpy as np

from kvsched.bench.stats import summarize

PROMPT = 512
BLOCK = 64


def _configs(
    running: int, model_dir: str, drafts: int = 0, order: str = "sync"
) -> tuple[Any, Any]:
    from kvsched.integrations.vllm.harness import configs

    blocks = running * (PROMPT // BLOCK + 8) + 1
    batched = 8192 + running * (1 + drafts)
    method = "ngram" if order == "sync" else "ngram_gpu"
    return configs(
        model_dir, blocks, running, batched, block_size=BLOCK, drafts=drafts, method=method
    )


def _requests(running: int) -> list[Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=100_000)
    return [
        Request(
            f"r{i}",
            rng.integers(3, 500, PROMPT).tolist(),
            params,
            None,
            block_hasher=hasher,
            arrival_time=float(i),
        )
        for i in range(running)
    ]


def _output(so: Any, sched: Any) -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(so.num_scheduled_tokens)
    requests, spec = sched.requests, so.scheduled_spec_decode_tokens or {}
    sampled = []
    for name in ids:
        r = requests.get(name)
        done = r is not None and r.num_computed_tokens >= r.num_tokens
        # (with drafts, the first is accepted: the proposals are 7s; under async scheduling
        # the scheduler's are placeholders, and the runner's own are 7s)
        sampled.append(([7, 8] if spec.get(name) else [7]) if done else [])
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={n: i for i, n in enumerate(ids)}, sampled_token_ids=sampled
    )


def _step(sched: Any, drafts: int = 0) -> tuple[int, float]:
    from vllm.v1.outputs import DraftTokenIds

    t0 = time.perf_counter()
    so = sched.schedule()
    t1 = time.perf_counter()
    mro = _output(so, sched)  # the model's part: not timed
    proposed = None
    if drafts:
        names = [n for n, got in zip(mro.req_ids, mro.sampled_token_ids, strict=True) if got]
        proposed = DraftTokenIds(names, [[7] * drafts for _ in names])
    t2 = time.perf_counter()
    sched.update_from_output(so, mro)
    if proposed is not None:
        sched.update_draft_token_ids(proposed)
    t3 = time.perf_counter()
    return len(so.num_scheduled_tokens), (t1 - t0 + t3 - t2) * 1e3


class _AsyncLoop:
    """vLLM's engine core under async scheduling (a batch queue of two): each iteration
    schedules a step, then gives back the output of the step scheduled before it."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.queue: deque[tuple[Any, Any]] = deque()

    def iterate(self) -> tuple[int, float]:
        """(requests in the step scheduled, the scheduler's ms in this iteration)."""
        t0 = time.perf_counter()
        so = self.sched.schedule()
        t1 = time.perf_counter()
        self.queue.appendleft((so, _output(so, self.sched)))  # the model's part: not timed
        ms = (t1 - t0) * 1e3
        if len(self.queue) == 2:
            done, mro = self.queue.pop()
            t2 = time.perf_counter()
            self.sched.update_from_output(done, mro)
            ms += (time.perf_counter() - t2) * 1e3
        return len(so.num_scheduled_tokens), ms

    def step(self) -> tuple[int, float]:
        """Iterations until one schedules work: (its requests, the scheduler's ms in all of
        them). vLLM's AsyncScheduler and kvsched's adapter (overlapped steps) work in every
        iteration."""
        total = 0.0
        for _ in range(3):
            n, ms = self.iterate()
            total += ms
            if n:
                return n, total
        raise RuntimeError("three engine iterations without work")


def _cold(step: Any) -> tuple[int, float]:
    """``step()`` after a full collection, with the collector off while it runs."""
    gc.collect()
    gc.disable()
    try:
        out: tuple[int, float] = step()
        return out
    finally:
        gc.enable()


def measure(
    kind: str,
    running: int,
    samples: int,
    vllm_config: Any,
    kv: Any,
    order: str = "sync",
    drafts: int = 0,
    heap: str = "engine",
) -> dict[Any, Any]:
    from kvsched.integrations.vllm.harness import make

    if order == "async" and kind == "vllm":
        kind = "vllm-async"  # (vLLM's own scheduler under async scheduling)
    # (the adapter overlaps steps under async scheduling, which vLLM's CPU build turns off)
    vllm_config.scheduler_config.async_scheduling = order == "async" and kind == "kvsched"
    sched = make(kind, vllm_config, kv)
    step = _AsyncLoop(sched).step if order == "async" else lambda: _step(sched, drafts)
    for r in _requests(running):
        sched.add_request(r)
    for _ in range(1000):  # prefill until every request decodes (not timed)
        step()
        if all(r.num_output_tokens > 0 for r in sched.requests.values()):
            break
    times = []
    if heap == "engine":
        gc.collect()
        gc.freeze()
    try:
        for _ in range(samples):
            n, ms = _cold(step) if heap == "cold" else step()
            if n != running:
                raise RuntimeError(f"{kind}: {n} of {running} requests scheduled in a timed step")
            times.append(ms)
    finally:
        gc.unfreeze()
    sched.shutdown()
    return {"impl": kind, **summarize(np.asarray(times))}


def run_vllm_bench(
    running: int = 1024,
    samples: int = 100,
    rounds: int = 3,
    order: str = "sync",
    drafts: int = 0,
    heap: str = "engine",
) -> list[dict[str, Any]]:
    from kvsched.integrations.vllm.models import build

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # (the adapter's start-up advice on RequestCheck, once per scheduler made, is not a result)
    logging.getLogger("kvsched.integrations.vllm.scheduler").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        model = build("qwen3", os.path.join(tmp, "model"))
        vllm_config, kv = _configs(running, str(model), drafts, order)
        out = []
        for round_ in range(1, rounds + 1):
            for kind in ("vllm", "kvsched"):
                out.append(
                    {
                        "round": round_,
                        "running": running,
                        "order": order,
                        "drafts": drafts,
                        "heap": heap,
                        **measure(kind, running, samples, vllm_config, kv, order, drafts, heap),
                    }
                )
    return out
