"""The driver: feeds a workload into an engine, runs the executor, advances the clock.

The clock is owned here (simulated: it advances by each step's cost-model duration, and jumps
to the next arrival when idle), never inside the engine. The driver also puts the executor
to sleep and wakes it as the engine decides (``execute_step``): after a step whose last
lifecycle decision is ``Drained`` has run, ``executor.sleep(level)``; before running a step
that ``Woken`` ends, ``executor.wake()``.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import attrs
import msgspec

from kvsched.engine import Engine, StepResult
from kvsched.events import types as ev
from kvsched.plan import StepPlan
from kvsched.replay.external import ExternalKV
from kvsched.replay.workload import Turn, Workload


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> ev.StepExecuted: ...

    def sleep(self, level: int) -> None:
        """Release device memory (nothing is held or cached then): level 1 the KV cache,
        level 2 the weights too. No plan runs until ``wake``."""

    def wake(self) -> None:
        """Restore what ``sleep`` released (a no-op when awake)."""


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


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (``KeyboardInterrupt``) during :func:`run`: ``steps`` engine steps completed,
    ``logged`` complete steps in the engine's event log (None: no log). The message is the
    one line the CLI prints."""

    def __init__(self, steps: int, logged: int | None) -> None:
        self.steps = steps
        self.logged = logged
        held = "" if logged is None else f"; the log holds {logged} complete steps"
        super().__init__(f"interrupted after {steps} steps{held}")


@attrs.frozen
class Resume:
    """Where a recovered run stands: what already arrived, when each request ended, the clock
    of its last complete step, and that step's plan (its outcome was lost in the crash)."""

    arrived: frozenset[int]
    ended_at: dict[int, float]
    clock: float
    plan: StepPlan


def run(
    engine: Engine,
    executor: Executor,
    workload: Workload,
    *,
    max_steps: int = 10_000_000,
    on_step: Callable[[StepResult], None] | None = None,
    on_executed: Callable[[StepResult, ev.StepExecuted, float], None] | None = None,
    resume: Resume | None = None,
    external: ExternalKV | None = None,
    controls: Sequence[tuple[float, ev.Event]] = (),
) -> RunSummary:
    """Run a workload to completion; returns totals.

    ``on_step(result)`` is called after each engine step, before its plan runs;
    ``on_executed(result, outcome, end_clock)`` after the executor ran a non-empty plan, with
    the simulated clock at the end of the step (when its sampled tokens exist). An executor
    that raises becomes a ``StepFailed`` input of the next step. ``resume`` continues a run
    recovered from its event log (see ``replay.recovery``). ``external`` connects the engine
    to a KV store (lookups, loads and saves; see ``replay.external``). ``controls``: inputs
    given at the first step whose clock reaches their time (e.g. a sleep:
    ``DrainRequested(level)``, later ``WakeRequested()``). With overlapped steps
    (``speculation.pipelined``) each step's outcome is an input of the step after next.
    """
    wall = time.perf_counter()
    followers: dict[int, list[Turn]] = {}
    queue: list[tuple[float, int, Turn]] = []  # (arrival, seq id, turn): ties by id
    arrived = resume.arrived if resume is not None else frozenset()
    ended = resume.ended_at if resume is not None else {}
    for turn in workload.turns:
        seq_id = turn.request.seq_id
        if seq_id in arrived:
            continue
        if turn.follows < 0:
            heapq.heappush(queue, (turn.arrival_s, seq_id, turn))
        elif turn.follows in ended:
            heapq.heappush(queue, (ended[turn.follows] + turn.think_s, seq_id, turn))
        else:
            followers.setdefault(turn.follows, []).append(turn)
    pending = sorted(controls, key=lambda c: c[0])  # (stable: same-time controls in order)
    clock = resume.clock if resume is not None else 0.0
    outcome: list[ev.Event] = []
    if resume is not None and not resume.plan.is_empty:
        clock = _execute(executor, resume.plan, outcome, clock)
    if resume is not None and external is not None:
        outcome.extend(ExternalKV.recovered_inputs(engine))
    summary = RunSummary()
    steps = 0
    # Overlapped steps: each step's outcome is an input of the step after next (the executor
    # runs a step while the next one is planned).
    pipelined = engine.config.speculation.pipelined
    late: list[ev.Event] = []
    try:
        for _ in range(max_steps):
            if pipelined:
                outcome, late = late, outcome
            transfers = external.inputs() if external is not None else []
            outcome.extend(transfers)
            busy = engine.has_work or bool(outcome) or bool(late)
            if not queue and not pending and not busy:
                break
            if not busy:  # idle: jump to the next arrival or control
                clock = max(clock, min([q[0] for q in queue[:1]] + [c[0] for c in pending[:1]]))
            inputs: list[ev.Event] = list(outcome)
            while queue and queue[0][0] <= clock:
                at, _, turn = heapq.heappop(queue)
                inputs.append(_replace_arrival(turn, at))
            while pending and pending[0][0] <= clock:
                inputs.append(pending.pop(0)[1])
            result = engine.step(inputs, clock)
            steps += 1
            if on_step is not None:
                on_step(result)
            for done in _ended(result.decisions):
                for turn in followers.pop(done, ()):
                    heapq.heappush(queue, (clock + turn.think_s, turn.request.seq_id, turn))
            outcome = []
            clock = execute_step(executor, result, outcome, clock)
            if outcome and on_executed is not None and isinstance(outcome[0], ev.StepExecuted):
                on_executed(result, outcome[0], clock)
            if external is not None:
                external.after_step(result.decisions)
                if result.plan.is_empty and not outcome:
                    external.wait()  # only transfers are outstanding: do not spin
    except KeyboardInterrupt as exc:
        logged = engine.log.records if engine.log is not None else None
        raise RunInterrupted(steps, logged) from exc
    _fill(summary, engine, clock, time.perf_counter() - wall)
    return summary


def execute_step(
    executor: Executor, result: StepResult, outcome: list[ev.Event], clock: float
) -> float:
    """Run a step's plan (unless empty; its outcome, or failure, goes to ``outcome``) with the
    executor's sleep and wake in the order of the step's ``Drained`` / ``Woken`` decisions:
    those before the last one, and the last one if it is ``Woken``, before the plan runs (a
    woken step's admissions need the cache); a last ``Drained`` after it (the step's plan,
    e.g. a finished sequence's final state save, runs before the memory goes). Returns the
    new clock."""
    changes = [d for d in result.decisions if isinstance(d, (ev.Drained, ev.Woken))]
    ends_asleep = bool(changes) and isinstance(changes[-1], ev.Drained)
    _sleep_or_wake(executor, changes[:-1] if ends_asleep else changes)
    if not result.plan.is_empty:
        clock = _execute(executor, result.plan, outcome, clock)
    if ends_asleep:
        _sleep_or_wake(executor, changes[-1:])
    return clock


def _sleep_or_wake(executor: Executor, changes: Sequence[ev.Drained | ev.Woken]) -> None:
    for change in changes:
        if isinstance(change, ev.Drained):
            executor.sleep(change.level)
        else:
            executor.wake()


def _execute(executor: Executor, plan: StepPlan, outcome: list[ev.Event], clock: float) -> float:
    """Run a plan; its outcome (or its failure) goes to ``outcome``; returns the new clock."""
    try:
        executed = executor.execute(plan)
    except Exception as exc:  # the executor's failure is an input, not a crash
        outcome.append(ev.StepFailed(plan.step, f"{type(exc).__name__}: {exc}"))
        return clock
    outcome.append(executed)
    return clock + executed.duration_s


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
