"""The driver: feeds a workload into an engine, runs the executor, advances the clock.

The clock is owned here (simulated: it advances by each step's cost-model duration, and jumps
to the next arrival when idle), never inside the engine.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import attrs
import msgspec

from kvsched.engine import Engine, StepResult
from kvsched.events import types as ev
from kvsched.reducers.plan import StepPlan
from kvsched.replay.workload import Turn, Workload


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> ev.StepExecuted: ...


@attrs.define
class RunSummary:
    requests: int = 0
    rejected: int = 0
    finished: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    sim_time_s: float = 0.0
    wall_time_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = attrs.asdict(self)
        out["token_hit_rate"] = self.hit_rate
        sim = self.sim_time_s
        out["throughput_tok_s"] = self.generated_tokens / sim if sim else 0.0
        return out


def _replace_arrival(turn: Turn, at: float) -> ev.RequestArrived:
    return msgspec.structs.replace(turn.request, arrival_time=at)


def run(
    engine: Engine,
    executor: Executor,
    workload: Workload,
    *,
    max_steps: int = 10_000_000,
    on_step: Callable[[StepResult], None] | None = None,
) -> RunSummary:
    """Run a workload to completion; returns totals."""
    wall = time.perf_counter()
    followers: dict[int, list[Turn]] = {}
    queue: list[tuple[float, int, Turn]] = []
    for i, turn in enumerate(workload.turns):
        if turn.follows >= 0:
            followers.setdefault(turn.follows, []).append(turn)
        else:
            heapq.heappush(queue, (turn.arrival_s, i, turn))
    order = len(workload.turns)
    clock = 0.0
    outcome: list[ev.Event] = []
    summary = RunSummary()
    for _ in range(max_steps):
        if not queue and not engine.has_work and not outcome:
            break
        if not engine.has_work and not outcome and queue[0][0] > clock:
            clock = queue[0][0]  # idle: jump to the next arrival
        inputs: list[ev.Event] = list(outcome)
        while queue and queue[0][0] <= clock:
            at, _, turn = heapq.heappop(queue)
            inputs.append(_replace_arrival(turn, at))
        result = engine.step(inputs, clock)
        if on_step is not None:
            on_step(result)
        for done in _ended(result.decisions):
            for turn in followers.pop(done, ()):
                order += 1
                heapq.heappush(queue, (clock + turn.think_s, order, turn))
        outcome = []
        if not result.plan.is_empty:
            executed = executor.execute(result.plan)
            outcome.append(executed)
            clock += executed.duration_s
    _fill(summary, engine, clock, time.perf_counter() - wall)
    return summary


def _ended(decisions: Iterable[ev.Event]) -> list[int]:
    ended: list[int] = []
    for d in decisions:
        if isinstance(d, ev.SequenceFinished):
            ended.extend(d.seq_ids.tolist())
        elif isinstance(d, (ev.SequenceAborted, ev.RequestRejected)):
            ended.append(d.seq_id)
    return ended


def _fill(summary: RunSummary, engine: Engine, clock: float, wall: float) -> None:
    s = engine.state.stats
    summary.requests = s.requests_arrived + s.requests_rejected
    summary.rejected = s.requests_rejected
    summary.finished = s.requests_finished
    summary.aborted = s.requests_aborted
    summary.prompt_tokens = s.query_tokens
    summary.generated_tokens = s.generated_tokens
    summary.prefill_tokens = s.prefill_tokens
    summary.hit_tokens = s.hit_tokens
    summary.query_tokens = s.query_tokens
    summary.preemptions = s.preemptions
    summary.steps = s.steps
    summary.sim_time_s = clock
    summary.wall_time_s = wall
