"""Replay metrics: what a replay measured, folded from each step's result and the clock.

``replay_workload`` is the one replay path (``kvsched replay`` and ``kvsched demo`` both use
it): it runs the driver with a ``Recorder`` attached and returns the run's ``ReplayResult``.

Definitions (all on the driver's simulated clock):

* TTFT: end of the step that sampled a request's first token minus its arrival time;
* TPOT: (last token's step end - first token's step end) / (output tokens - 1), for requests
  with at least two output tokens;
* token hit rate: prompt tokens attached from the local prefix cache at a request's first
  admission / prompt tokens (``PrefixMatched``; re-admissions after preemption are not
  counted), plus prompt tokens admitted to be loaded from an external KV store
  (``KVLoadAdmitted``; a load that later fails still counts here);
* cache use: blocks held by running sequences or sessions / usable blocks, and blocks holding
  any KV (held plus cached-evictable) / usable blocks;
* queue length: waiting requests at the start of each step (after the step's arrivals);
* evictions: cached KV blocks reused for other data (``kv_block_evictions``; ``evictions``
  is its old name) and hybrid state checkpoints evicted (``checkpoint_evictions``).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from kvsched.engine import Engine, StepResult
from kvsched.events import types as ev
from kvsched.replay.driver import Executor, RunSummary, run
from kvsched.replay.workload import Workload

HIT_NOTE = (
    "local KV: prompt tokens served from attention-only prefix hits; checkpoint: served by a "
    "hybrid model's restored state checkpoints; kv_only_unusable: cached KV a hybrid model "
    "could not use for lack of a checkpoint; external: admitted to be loaded from the KV store"
)


def percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


@attrs.define
class Series:
    """Per-step time series (one entry per engine step)."""

    clock: list[float] = attrs.field(factory=list)
    waiting: list[int] = attrs.field(factory=list)
    running: list[int] = attrs.field(factory=list)
    held: list[int] = attrs.field(factory=list)  # blocks with a holder
    used: list[int] = attrs.field(factory=list)  # blocks holding KV (held + cached)
    hit_tokens: list[int] = attrs.field(factory=list)
    query_tokens: list[int] = attrs.field(factory=list)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in attrs.asdict(self).items()}


class Recorder:
    """Folds each ``StepResult`` (and each executed step's end time) into metrics."""

    def __init__(self, engine: Engine, workload: Workload) -> None:
        self.engine = engine
        ids = np.asarray([t.request.seq_id for t in workload.turns], dtype=np.int64)
        self.ids = np.unique(ids)
        n = len(self.ids)
        # Request ids 0 .. n-1 (every built-in workload and trace reader): index directly.
        self.dense = bool(n == 0 or (self.ids[0] == 0 and self.ids[-1] == n - 1))
        self.arrival = np.full(n, np.nan)
        self.first = np.full(n, np.nan)
        self.last = np.full(n, np.nan)
        self.tokens = np.zeros(n, dtype=np.int64)
        self.hit = np.zeros(n, dtype=np.int64)  # prompt tokens hit at the first admission
        self.query = np.zeros(n, dtype=np.int64)
        self.rejections: Counter[str] = Counter()
        self._sampled: list[np.ndarray] = []
        self._ends: list[float] = []
        self.series = Series()
        self.usable = engine.config.num_blocks - 1

    def index(self, seq_ids: np.ndarray) -> np.ndarray:
        return seq_ids if self.dense else np.searchsorted(self.ids, seq_ids)

    def index1(self, seq_id: int) -> int:
        return seq_id if self.dense else int(np.searchsorted(self.ids, seq_id))

    def on_step(self, result: StepResult) -> None:
        state = self.engine.state
        pool = state.pool
        for e in result.inputs:
            if isinstance(e, ev.RequestArrived):
                self.arrival[self.index1(e.seq_id)] = e.arrival_time
        for d in result.decisions:
            if isinstance(d, ev.PrefixMatched) and d.num_query_tokens:
                i = self.index1(d.seq_id)
                self.hit[i] = d.num_tokens
                self.query[i] = d.num_query_tokens
            elif isinstance(d, ev.RequestRejected):
                self.rejections[_reason_kind(d.reason)] += 1
        s = self.series
        free = len(pool.free)
        s.clock.append(result.plan.clock)
        s.waiting.append(len(state.seqs.waiting))
        s.running.append(state.seqs.num_running)
        s.used.append(self.usable - free)
        s.held.append(self.usable - free - pool.num_evictable)
        s.hit_tokens.append(result.plan.num_hit_tokens)
        s.query_tokens.append(result.plan.num_query_tokens)

    def on_executed(self, result: StepResult, outcome: ev.StepExecuted, end: float) -> None:
        # Folded lazily (``_fold_tokens``): a step costs two list appends.
        if len(outcome.seq_ids):
            self._sampled.append(outcome.seq_ids)
            self._ends.append(end)

    def _fold_tokens(self) -> None:
        """Fold the sampled-token records: first and last token times, tokens per request."""
        if not self._sampled:
            return
        counts = np.fromiter((len(a) for a in self._sampled), np.int64, len(self._sampled))
        idx = self.index(np.concatenate(self._sampled))
        times = np.repeat(np.asarray(self._ends, dtype=np.float64), counts)
        self._sampled, self._ends = [], []
        n = len(self.ids)
        self.tokens += np.bincount(idx, minlength=n)
        firsts = np.full(n, np.inf)
        np.minimum.at(firsts, idx, times)
        lasts = np.full(n, -np.inf)
        np.maximum.at(lasts, idx, times)
        seen = np.isfinite(firsts)
        self.first = np.where(seen & np.isnan(self.first), firsts, self.first)
        self.last = np.where(seen, lasts, self.last)

    # ------------------------------------------------------------------- summary

    def latencies(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self._fold_tokens()
        done = ~np.isnan(self.first) & ~np.isnan(self.arrival)
        ttft = (self.first - self.arrival)[done]
        multi = done & (self.tokens >= 2)
        tpot = ((self.last - self.first)[multi]) / (self.tokens[multi] - 1)
        e2e = (self.last - self.arrival)[done]
        return ttft, tpot, e2e

    def metrics(self, summary: RunSummary) -> dict[str, Any]:
        pool = self.engine.state.pool
        config = self.engine.config
        stats, query = self.engine.state.stats, summary.query_tokens
        ttft, tpot, e2e = self.latencies()
        sim = summary.sim_time_s
        s = self.series
        out: dict[str, Any] = {
            "requests": summary.requests,
            "finished": summary.finished,
            "rejected": summary.rejected,
            "aborted": summary.aborted,
            "rejections": dict(sorted(self.rejections.items())),
            "prompt_tokens": summary.prompt_tokens,
            "generated_tokens": summary.generated_tokens,
            "prefill_tokens": summary.prefill_tokens,
            "hit_tokens": summary.hit_tokens,
            "query_tokens": summary.query_tokens,
            "token_hit_rate": _ratio(summary.hit_tokens + stats.external_hit_tokens, query),
            "hit_rate_local_kv": _ratio(stats.hit_tokens - stats.ckpt_hit_tokens, query),
            "hit_rate_checkpoint": _ratio(stats.ckpt_hit_tokens, query),
            "kv_only_unusable_rate": _ratio(stats.kv_only_hit_tokens, query),
            "hit_rate_external": _ratio(stats.external_hit_tokens, query),
            "hit_rate_note": HIT_NOTE,
            "throughput_tok_s": summary.generated_tokens / sim if sim else 0.0,
            "prompt_throughput_tok_s": summary.prompt_tokens / sim if sim else 0.0,
            "requests_per_s": summary.finished / sim if sim else 0.0,
            "ttft_mean_s": float(ttft.mean()) if len(ttft) else 0.0,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "tpot_mean_s": float(tpot.mean()) if len(tpot) else 0.0,
            "tpot_p50_s": percentile(tpot, 50),
            "tpot_p90_s": percentile(tpot, 90),
            "tpot_p99_s": percentile(tpot, 99),
            "e2e_p50_s": percentile(e2e, 50),
            "e2e_p99_s": percentile(e2e, 99),
            "preemptions": summary.preemptions,
            "kv_block_evictions": pool.num_evictions,
            "checkpoint_evictions": self.engine.state.ckpts.evictions,
            "evictions": pool.num_evictions,  # the old name of kv_block_evictions
            "max_waiting": max(s.waiting, default=0),
            "max_cache_use": max(s.used, default=0) / self.usable,
            "max_cache_held": max(s.held, default=0) / self.usable,
            "steps": summary.steps,
            "sim_time_s": sim,
            "wall_time_s": summary.wall_time_s,
            "block_size": config.block_size,
            "cache_blocks": config.num_blocks,
            "cache_tokens": config.num_blocks * config.block_size,
            "max_batch": config.max_batch,
            "max_prefill_tokens": config.max_prefill_tokens,
            "hybrid": config.hybrid,
        }
        return out


def _reason_kind(reason: str) -> str:
    """A rejection reason without its numbers, to count rejections by kind."""
    return re.sub(r"-?\d[\d,]*", "N", reason)


@attrs.frozen
class ReplayResult:
    summary: RunSummary
    metrics: dict[str, Any]
    series: dict[str, np.ndarray]
    recorder: Recorder


Driver = Callable[..., RunSummary]


def replay_workload(
    engine: Engine,
    executor: Executor,
    workload: Workload,
    *,
    progress: Callable[[int], None] | None = None,
    driver: Driver = run,
) -> ReplayResult:
    """Run ``workload`` through ``engine`` with a metrics recorder attached.

    ``progress(n)`` is called after each step with the number of requests done (finished,
    rejected or aborted).
    """
    recorder = Recorder(engine, workload)
    stats = engine.state.stats

    def on_step(result: StepResult) -> None:
        recorder.on_step(result)
        if progress is not None:
            progress(stats.requests_finished + stats.requests_rejected + stats.requests_aborted)

    wall = time.perf_counter()
    summary = driver(engine, executor, workload, on_step=on_step, on_executed=recorder.on_executed)
    summary.wall_time_s = time.perf_counter() - wall
    return ReplayResult(summary, recorder.metrics(summary), recorder.series.arrays(), recorder)


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
