"""Runs of a workload: the one replay path of ``kvsched demo`` and ``kvsched replay`` (driver +
metrics recorder + progress), one run of a trace, and a sweep of one config key."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from kvsched.config import SchedulerConfig
from kvsched.engine import Engine
from kvsched.events.wire import Publisher
from kvsched.replay.driver import Executor, run
from kvsched.replay.external import ExternalKV
from kvsched.replay.future import future_for
from kvsched.replay.metrics import ReplayResult, replay_workload
from kvsched.replay.setup import Sweep, TraceReplay, make_executor, open_log, sweep_config
from kvsched.replay.workload import Workload
from kvsched.stream.publish import open_publisher

Progress = Callable[[str, int], contextlib.AbstractContextManager[Callable[[int], None] | None]]
"""``progress(desc, total)`` opens a progress display for a run of ``total`` requests; the
context's value, unless None, is called after each step with the number of requests done."""


@contextlib.contextmanager
def no_progress(desc: str, total: int) -> Iterator[None]:
    """The ``Progress`` that shows nothing."""
    yield None


def replay(
    engine: Engine,
    executor: Executor,
    workload: Workload,
    *,
    desc: str = "replay",
    progress: Progress = no_progress,
    external: ExternalKV | None = None,
) -> ReplayResult:
    """Run ``workload`` through ``engine`` and ``executor`` (through the ``external`` KV
    bridge when given) with a metrics recorder attached and a ``progress`` named ``desc``.
    Under the oracle's rules each arrival carries the trace's future (``replay/future.py``;
    SetupError for a workload without one, such as session turns)."""
    workload = future_for(engine.config, workload)
    driver = functools.partial(run, external=external) if external is not None else run
    with progress(desc, len(workload.turns)) as update:
        return replay_workload(engine, executor, workload, progress=update, driver=driver)


def replay_trace(
    setup: TraceReplay,
    config: SchedulerConfig,
    *,
    log: str | None = None,
    publish: str | None = None,
    wait_subscribers: int = 0,
    check: bool = False,
    progress: Progress = no_progress,
) -> ReplayResult:
    """One run of the trace on a fresh engine, recorded to the event log ``log`` and
    published on the ZeroMQ endpoint ``publish`` if given."""
    executor = make_executor(setup.executor, config, setup.cost, setup.model)
    event_log = open_log(log, config)
    sinks: list[Publisher] = []
    try:
        if publish:
            sinks.append(open_publisher(publish, config, wait_subscribers))
        engine = Engine(config, log=event_log, sinks=sinks, check_invariants=check)
        return replay(engine, executor, setup.trace.workload, progress=progress)
    finally:
        if event_log is not None:
            event_log.close()
        for sink in sinks:
            sink.close()


@attrs.frozen
class SweepRun:
    """One run of a sweep: ``metrics`` are the run's, the trace's extra ones
    (``TraceReplay.extra``), the sweep point (``sweep_key``, ``sweep_value``) and the
    checkpoint policy (``checkpoint_policy``, "" when not compared) with the state memory
    its budget allows (``state_memory_bytes``)."""

    value: int
    metrics: dict[str, Any]
    result: ReplayResult
    policy: str = ""


Point = tuple[str, str, int]
"""One sweep point: (checkpoint policy or "", sweep key or "", value)."""


def sweep_points(policies: Sequence[str], sweep: Sweep | Sequence[Sweep] | None) -> list[Point]:
    """Every (policy, key, value) of a sweep: per policy, each key's values in order."""
    if sweep is None or not sweep:
        sweeps: Sequence[Sweep] = [("", [0])]
    elif isinstance(sweep[0], str):
        sweeps = [sweep]  # type: ignore[list-item]
    else:
        sweeps = sweep  # type: ignore[assignment]
    return [(p, k, v) for p in policies or ("",) for k, values in sweeps for v in values]


def sweep_runs(
    setup: TraceReplay,
    config: SchedulerConfig,
    sweep: Sweep | Sequence[Sweep] | None,
    *,
    check: bool = False,
    progress: Progress = no_progress,
    jobs: int = 1,
) -> Iterator[SweepRun]:
    """Replay the trace once per point of ``sweep`` (one or more (KEY, values)) and per
    checkpoint policy of ``setup.policies`` (when given), each on a fresh engine whose config
    is ``config`` with KEY set and the policy's rules; yields each run in point order. With
    ``jobs`` > 1 the points run in that many forked worker processes (no progress bars: each
    run's progress is the ``progress`` context opened as it is yielded)."""
    points = sweep_points(setup.policies, sweep)
    if jobs <= 1 or len(points) <= 1:
        for point in points:
            yield run_point(setup, config, point, check=check, progress=progress)
        return
    yield from _parallel(setup, config, points, check, jobs)


def run_point(
    setup: TraceReplay,
    config: SchedulerConfig,
    point: Point,
    *,
    check: bool = False,
    progress: Progress = no_progress,
) -> SweepRun:
    """One sweep point's run on a fresh engine."""
    policy, key, value = point
    base = config.with_checkpoint_policy(policy) if policy else config
    cfg = sweep_config(base, key, value) if key else base
    executor = make_executor(setup.executor, cfg, setup.cost, setup.model)
    engine = Engine(cfg, check_invariants=check)
    desc = " ".join(filter(None, (policy, f"{key}={value}" if key else "")))
    result = replay(engine, executor, setup.trace.workload, desc=desc, progress=progress)
    metrics = {
        **result.metrics,
        **setup.extra(),
        "sweep_key": key,
        "sweep_value": value,
        "checkpoint_policy": policy,
        "state_memory_bytes": cfg.num_checkpoint_slots * cfg.model.state_bytes,
    }
    return SweepRun(value, metrics, result, policy)


_WORKER: list[tuple[TraceReplay, SchedulerConfig, bool]] = []
"""In a forked sweep worker only: the trace and config it runs points of (set once by
``_start_worker``; the fork start method hands them over without pickling)."""


def _start_worker(setup: TraceReplay, config: SchedulerConfig, check: bool) -> None:
    _WORKER.append((setup, config, check))


def _worker_point(point: Point) -> SweepRun:
    """A worker's run of one point of the trace it was started with."""
    setup, config, check = _WORKER[0]
    return run_point(setup, config, point, check=check)


def _parallel(
    setup: TraceReplay, config: SchedulerConfig, points: list[Point], check: bool, jobs: int
) -> Iterator[SweepRun]:
    """The points' runs in ``jobs`` forked processes, yielded in point order."""
    with cf.ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=multiprocessing.get_context("fork"),
        initializer=_start_worker,
        initargs=(setup, config, check),
    ) as pool:
        yield from pool.map(_worker_point, points)
