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
    drive = Drive(
        engine,
        executor,
        workload,
        on_step=on_step,
        on_executed=on_executed,
        resume=resume,
        external=external,
        controls=controls,
    )
    try:
        for _ in range(max_steps):
            if not drive.advance():
                break
    except KeyboardInterrupt as exc:
        logged = engine.log.records if engine.log is not None else None
        raise RunInterrupted(drive.steps, logged) from exc
    return drive.summary(time.perf_counter() - wall)


class Drive:
    """One engine's run, a step at a time (``advance``): the loop of ``run``, which a
    cluster (``replay.cluster``) interleaves across engines. It owns the run's arrival queue,
    closed-loop followers, timed controls, the simulated clock and the outcomes not yet given
    to the engine. ``add`` queues a turn that arrives at a given time (a router's choice);
    ``on_ended(seq_id, clock)``, when set, is told of each request that ends instead of this
    run releasing its own followers."""

    def __init__(
        self,
        engine: Engine,
        executor: Executor,
        workload: Workload,
        *,
        on_step: Callable[[StepResult], None] | None = None,
        on_executed: Callable[[StepResult, ev.StepExecuted, float], None] | None = None,
        resume: Resume | None = None,
        external: ExternalKV | None = None,
        controls: Sequence[tuple[float, ev.Event]] = (),
    ) -> None:
        self.engine, self.executor, self.external = engine, executor, external
        self.on_step, self.on_executed = on_step, on_executed
        self.on_ended: Callable[[int, float], None] | None = None
        self.followers: dict[int, list[Turn]] = {}
        self.queue: list[tuple[float, int, Turn]] = []  # (arrival, seq id, turn): ties by id
        arrived = resume.arrived if resume is not None else frozenset()
        ended = resume.ended_at if resume is not None else {}
        for turn in workload.turns:
            seq_id = turn.request.seq_id
            if seq_id in arrived:
                continue
            if turn.follows < 0:
                heapq.heappush(self.queue, (turn.arrival_s, seq_id, turn))
            elif turn.follows in ended:
                heapq.heappush(self.queue, (ended[turn.follows] + turn.think_s, seq_id, turn))
            else:
                self.followers.setdefault(turn.follows, []).append(turn)
        # (stable: same-time controls in order)
        self.pending = sorted(controls, key=lambda c: c[0])
        self.clock = resume.clock if resume is not None else 0.0
        self.outcome: list[ev.Event] = []
        if resume is not None and not resume.plan.is_empty:
            self.clock = _execute(executor, resume.plan, self.outcome, self.clock)
        if resume is not None and external is not None:
            self.outcome.extend(ExternalKV.recovered_inputs(engine))
        self.steps = 0
        # Overlapped steps: each step's outcome is an input of the step after next (the
        # executor runs a step while the next one is planned).
        self.pipelined = engine.config.speculation.pipelined
        self.late: list[ev.Event] = []

    def add(self, turn: Turn, at: float) -> None:
        """Queue ``turn``, arriving at ``at``."""
        heapq.heappush(self.queue, (at, turn.request.seq_id, turn))

    @property
    def busy(self) -> bool:
        """Whether the engine has work, or outcomes or arrivals are still to be given to it."""
        return self.engine.has_work or bool(self.outcome or self.late or self.queue or self.pending)

    def advance(self) -> bool:
        """One engine step (or the end of the run: False, nothing done)."""
        engine, external = self.engine, self.external
        if self.pipelined:
            self.outcome, self.late = self.late, self.outcome
        outcome = self.outcome
        if external is not None:
            outcome.extend(external.inputs())
        busy = engine.has_work or bool(outcome) or bool(self.late)
        queue, pending = self.queue, self.pending
        if not queue and not pending and not busy:
            return False
        if not busy:  # idle: jump to the next arrival or control
            nxt = [q[0] for q in queue[:1]] + [c[0] for c in pending[:1]]
            self.clock = max(self.clock, min(nxt))
        clock = self.clock
        inputs: list[ev.Event] = list(outcome)
        while queue and queue[0][0] <= clock:
            at, _, turn = heapq.heappop(queue)
            inputs.append(_replace_arrival(turn, at))
        while pending and pending[0][0] <= clock:
            inputs.append(pending.pop(0)[1])
        result = engine.step(inputs, clock)
        self.steps += 1
        if self.on_step is not None:
            self.on_step(result)
        for done in _ended(result.decisions):
            self._release(done, clock)
        self.outcome = outcome = []
        self.clock = execute_step(self.executor, result, outcome, clock)
        if outcome and self.on_executed is not None and isinstance(outcome[0], ev.StepExecuted):
            self.on_executed(result, outcome[0], self.clock)
        if external is not None:
            external.after_step(result.decisions)
            if result.plan.is_empty and not outcome:
                external.wait()  # only transfers are outstanding: do not spin
        return True

    def _release(self, seq_id: int, clock: float) -> None:
        """A request ended at ``clock``: its followers arrive after their think time."""
        if self.on_ended is not None:
            self.on_ended(seq_id, clock)
            return
        for turn in self.followers.pop(seq_id, ()):
            heapq.heappush(self.queue, (clock + turn.think_s, turn.request.seq_id, turn))

    def summary(self, wall: float) -> RunSummary:
        """The run's totals so far (``wall``: the seconds it took)."""
        summary = RunSummary()
        _fill(summary, self.engine, self.clock, wall)
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
