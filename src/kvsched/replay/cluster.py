"""A cluster what-if: one trace across several simulated engines behind a router.

Each engine is a kvsched engine with its own simulated executor and clock, run a step at a
time (``driver.Drive``). The cluster loop always steps the engine whose clock is earliest
among those with work before the next arrival; once none has, the next request (in arrival,
then id order) is routed and queued on the chosen engine. So a router sees every engine as
it stands at the request's arrival, and with one engine the run is the plain replay's, step
for step (same decisions, same log bytes).

Routes (``ROUTES``), each deterministic (ties go to the engine with fewer outstanding
requests, then to the one sent fewer requests so far, then to the lower index: an idle
cluster spreads new prefixes as a router breaking ties at random would, on average):

* ``round_robin``: engines in turn;
* ``least_loaded``: fewest outstanding requests (sent and not ended: the router's own count,
  as vllm-router's and SGLang's load policies keep it);
* ``cache_aware``: SGLang's cache-aware rule, vllm-router's default policy: the router's own
  record of the prompts it sent each engine, not the engines' caches (``Router._cache_aware``);
* ``kv_aware``: the cost of NVIDIA Dynamo's KV router, which vllm-router's ``kv_aware``
  follows: ``weight * prefill_blocks + decode_blocks``, where ``prefill_blocks`` is the
  engine's outstanding prefill work plus this prompt's uncached tokens, in blocks, and
  ``decode_blocks`` the blocks its outstanding requests' prompts take plus this prompt's;
  the minimum cost wins (``--router-temperature 0``). The cached part is what the engine's
  KV events tell a router: the attention KV it holds (``PrefixProbe.kv_tokens``). For a
  hybrid model that over-counts: a hit ends at the deepest state checkpoint;
* ``kv_aware_state``: the same cost with the hit a hybrid request would really get
  (``PrefixProbe.hit_tokens``), what kvsched's checkpoint events let a router know.

A session's later turns go to the engine holding the session (its history lives there),
whatever the route. The routers' bookkeeping (outstanding requests, blocks, prefill tokens)
is folded from what engines report back: a first token ends a request's prefill, an end
(finished, aborted, rejected) ends the request.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kvsched.engine import Engine, StepResult
from kvsched.events import types as ev
from kvsched.identity import DIGEST_SIZE, HashChain, chain_packed
from kvsched.replay.driver import Drive, Executor
from kvsched.replay.metrics import Recorder, ReplayResult, percentile
from kvsched.replay.workload import Turn, Workload

ROUTES = ("round_robin", "least_loaded", "cache_aware", "kv_aware", "kv_aware_state")
OVERLAP_WEIGHT = 1.0  # Dynamo's kv_overlap_score_weight default
# cache_aware's defaults (SGLang's router, SMG and vllm-router: --cache-threshold,
# --balance-abs-threshold, --balance-rel-threshold)
CACHE_THRESHOLD, BALANCE_ABS, BALANCE_REL = 0.3, 64, 1.5
# cache_aware names the prompt blocks it sent by their token chain alone (one namespace: the
# router sees tokens, not adapters or salts), with kvsched's block identity kernel
IDENTITY, ROOT = "kvs128", bytes(DIGEST_SIZE)


class Router:
    """Chooses an engine per request and keeps the bookkeeping its route reads."""

    def __init__(self, route: str, engines: Sequence[Engine], block_size: int) -> None:
        if route not in ROUTES:
            raise ValueError(f"unknown route {route!r}: expected one of {', '.join(ROUTES)}")
        self.route, self.engines, self.bs = route, engines, block_size
        n = len(engines)
        self.outstanding = [0] * n
        self.blocks = [0] * n  # prompt blocks of outstanding requests
        self.prefill = [0] * n  # uncached prompt tokens of requests without a first token
        self._open: dict[int, tuple[int, int, int]] = {}  # seq -> (engine, blocks, uncached)
        self._sessions: dict[int, int] = {}  # session id -> engine
        self.sent = [0] * n  # requests sent to each engine so far
        self.trees: list[set[bytes]] = [set() for _ in range(n)]  # cache_aware's own view
        self._turn = 0

    def choose(self, request: ev.RequestArrived) -> int:
        """The engine ``request`` goes to; it is counted there as outstanding."""
        uncached = len(request.prompt)
        k = self._sessions.get(request.session_id, -1) if request.session_id >= 0 else -1
        if k < 0:
            k, uncached = self._pick(request)
            if request.session_id >= 0:
                self._sessions[request.session_id] = k
        blocks = -(-len(request.prompt) // self.bs)
        self._open[request.seq_id] = (k, blocks, uncached)
        self.outstanding[k] += 1
        self.sent[k] += 1
        self.blocks[k] += blocks
        self.prefill[k] += uncached
        return k

    def _pick(self, request: ev.RequestArrived) -> tuple[int, int]:
        n, prompt = len(self.engines), len(request.prompt)
        if self.route == "round_robin":
            self._turn += 1
            return (self._turn - 1) % n, prompt
        if self.route == "least_loaded":
            return self._least_loaded(), prompt
        if self.route == "cache_aware":
            return self._cache_aware(request), prompt
        costs = []
        for k, engine in enumerate(self.engines):
            probe = engine.probe_prefix(request)
            cached = probe.kv_tokens if self.route == "kv_aware" else probe.hit_tokens
            uncached = prompt - cached
            prefill = (self.prefill[k] + uncached) / self.bs
            decode = self.blocks[k] + -(-prompt // self.bs)
            cost = OVERLAP_WEIGHT * prefill + decode
            costs.append((cost, self.outstanding[k], self.sent[k], k, uncached))
        best = min(costs)
        return best[3], best[4]

    def _least_loaded(self) -> int:
        n = len(self.engines)
        return min(range(n), key=lambda k: (self.outstanding[k], self.sent[k], k))

    def _cache_aware(self, request: ev.RequestArrived) -> int:
        """SGLang's cache-aware rule over the router's own record of the prompts it sent
        each engine (block by block here; the routers match characters or tokens, and evict
        their trees by age): the least loaded engine while the load is unbalanced (outstanding
        requests differ by more than 64 and by more than 1.5 times); else the engine matching
        the longest prefix if it matches more than 30 % of the prompt; else the engine whose
        record is smallest (the most room)."""
        keys = HashChain(chain_packed(IDENTITY, ROOT, ROOT, request.prompt, self.bs))
        loads, n = self.outstanding, len(self.engines)
        if max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads):
            k = self._least_loaded()
        else:
            matched = [keys.longest_prefix_in(tree, len(keys)) for tree in self.trees]
            k = min(range(n), key=lambda k: (-matched[k], loads[k], self.sent[k], k))
            if matched[k] * self.bs <= CACHE_THRESHOLD * len(request.prompt):
                sizes = [len(tree) for tree in self.trees]
                k = min(range(n), key=lambda k: (sizes[k], loads[k], self.sent[k], k))
        self.trees[k].update(keys)
        return k

    def first_token(self, seq_id: int) -> None:
        """``seq_id`` sampled its first token: its prefill is no longer outstanding."""
        k, blocks, uncached = self._open.get(seq_id, (-1, 0, 0))
        if k >= 0 and uncached:
            self.prefill[k] -= uncached
            self._open[seq_id] = (k, blocks, 0)

    def ended(self, seq_id: int) -> None:
        """``seq_id`` ended (finished, aborted or rejected)."""
        self.first_token(seq_id)
        k, blocks, _ = self._open.pop(seq_id, (-1, 0, 0))
        if k >= 0:
            self.outstanding[k] -= 1
            self.blocks[k] -= blocks


@attrs.frozen
class ClusterRun:
    """A cluster run: the route, each engine's replay result (its own metrics, as a plain
    replay reports them), the engine each request went to (-1: never sent), and the
    cluster's metrics (``cluster_metrics``)."""

    route: str
    engines: tuple[ReplayResult, ...]
    routed: np.ndarray
    metrics: dict[str, Any]


def run_cluster(
    engines: Sequence[Engine],
    executors: Sequence[Executor],
    workload: Workload,
    route: str,
    *,
    progress: Callable[[int], None] | None = None,
    max_steps: int = 100_000_000,
) -> ClusterRun:
    """Replay ``workload`` across ``engines`` (each with its executor) behind ``route``.
    ``progress(n)`` is called after each step with the number of requests ended."""
    wall = time.perf_counter()
    router = Router(route, engines, engines[0].config.block_size)
    ids = np.asarray(sorted(t.request.seq_id for t in workload.turns), dtype=np.int64)
    routed = np.full(len(ids), -1, dtype=np.int64)
    heap: list[tuple[float, int, Turn]] = []
    followers: dict[int, list[Turn]] = {}
    for turn in workload.turns:
        if turn.follows < 0:
            heap.append((turn.arrival_s, turn.request.seq_id, turn))
        else:
            followers.setdefault(turn.follows, []).append(turn)
    heapq.heapify(heap)
    done = [0]

    def ended(seq_id: int, clock: float) -> None:
        router.ended(seq_id)
        done[0] += 1
        for turn in followers.pop(seq_id, ()):
            heapq.heappush(heap, (clock + turn.think_s, turn.request.seq_id, turn))

    drives, recorders = _drives(engines, executors, workload, router, ended)
    for _ in range(max_steps):
        nxt = heap[0][0] if heap else float("inf")
        ready = [(d.clock, k) for k, d in enumerate(drives) if d.busy and d.clock < nxt]
        if ready:
            drives[min(ready)[1]].advance()
            if progress is not None:
                progress(done[0])
            continue
        if not heap:
            break
        at, seq_id, turn = heapq.heappop(heap)
        k = router.choose(turn.request)
        routed[np.searchsorted(ids, seq_id)] = k
        drives[k].add(turn, at)
    results = []
    for drive, rec in zip(drives, recorders, strict=True):
        summary = drive.summary(time.perf_counter() - wall)
        results.append(ReplayResult(summary, rec.metrics(summary), rec.series.arrays(), rec))
    metrics = cluster_metrics(results, routed, route)
    metrics["wall_time_s"] = time.perf_counter() - wall
    return ClusterRun(route, tuple(results), routed, metrics)


def _drives(
    engines: Sequence[Engine],
    executors: Sequence[Executor],
    workload: Workload,
    router: Router,
    ended: Callable[[int, float], None],
) -> tuple[list[Drive], list[Recorder]]:
    """A drive and a metrics recorder per engine, reporting first tokens and ends to the
    router (and ends to the cluster, which releases session followers)."""
    empty = Workload(workload.name, ())
    drives, recorders = [], []
    for engine, executor in zip(engines, executors, strict=True):
        rec = Recorder(engine, workload)

        def executed(
            result: StepResult, outcome: ev.StepExecuted, end: float, rec: Recorder = rec
        ) -> None:
            rec.on_executed(result, outcome, end)
            for seq_id in outcome.seq_ids.tolist():
                router.first_token(seq_id)

        drive = Drive(engine, executor, empty, on_step=rec.on_step, on_executed=executed)
        drive.on_ended = ended
        drives.append(drive)
        recorders.append(rec)
    return drives, recorders


def cluster_metrics(
    results: Sequence[ReplayResult], routed: np.ndarray, route: str
) -> dict[str, Any]:
    """The cluster's metrics: TTFT and TPOT over every request, the token hit rate over
    every prompt, and how evenly requests and prefill work spread (max / mean over
    engines: 1.0 is even)."""
    latencies = [r.recorder.latencies() for r in results]
    ttft = np.concatenate([t for t, _, _ in latencies])
    tpot = np.concatenate([p for _, p, _ in latencies])
    query = sum(r.metrics["query_tokens"] for r in results)
    # (each engine's hit tokens, local and external, as its own hit rate counts them)
    hits = sum(round(r.metrics["token_hit_rate"] * r.metrics["query_tokens"]) for r in results)
    requests = np.bincount(routed[routed >= 0], minlength=len(results))
    prefill = np.asarray([r.metrics["prefill_tokens"] for r in results], dtype=np.float64)
    return {
        "route": route,
        "engines": len(results),
        "requests": int((routed >= 0).sum()),
        "finished": sum(r.metrics["finished"] for r in results),
        "rejected": sum(r.metrics["rejected"] for r in results),
        "token_hit_rate": hits / query if query else 0.0,
        "hit_tokens": hits,
        "query_tokens": int(query),
        "ttft_mean_s": float(ttft.mean()) if len(ttft) else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "sim_time_s": max((r.metrics["sim_time_s"] for r in results), default=0.0),
        "requests_per_engine": requests.tolist(),
        "request_imbalance": _imbalance(requests.astype(np.float64)),
        "prefill_imbalance": _imbalance(prefill),
        "per_engine": [_engine_row(r.metrics) for r in results],
    }


def _imbalance(values: np.ndarray) -> float:
    mean = float(values.mean()) if len(values) else 0.0
    return float(values.max()) / mean if mean else 1.0


def _engine_row(m: dict[str, Any]) -> dict[str, Any]:
    keys = ("requests", "token_hit_rate", "ttft_p50_s", "ttft_p99_s", "prefill_tokens")
    return {k: m[k] for k in keys}
