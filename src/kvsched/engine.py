"""The engine shell: wires inputs, policy, reducers, plan, log and bus for one step at a time.

    decisions = [StepStarted] + policy(inputs) + policy.schedule(state)
    plan      = plan_step(state)
    log      <- StepRecord(step, clock, inputs, decisions)

The engine never runs the executor: its caller (a driver) does, and feeds the outcome back as
an input of the next step. The engine holds no clock: the caller passes each step's clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

import kvsched
from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.events.bus import EventBus
from kvsched.events.codec import StepRecord, encode
from kvsched.events.log import EventLog
from kvsched.policy import Policy
from kvsched.reducers.plan import StepPlan, plan_step
from kvsched.reducers.state import EngineState, ReplayMismatch


@attrs.frozen
class StepResult:
    step: int
    plan: StepPlan
    inputs: tuple[ev.Event, ...]
    decisions: tuple[ev.Event, ...]


def create_log(path: str, config: SchedulerConfig) -> EventLog:
    """Open a new event log for a run with this config (fails before any work is done)."""
    return EventLog.create(
        path,
        schema_version=kvsched.SCHEMA_VERSION,
        kvsched_version=kvsched.__version__,
        config=config.to_dict(),
    )


class Engine:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        log: EventLog | None = None,
        bus: EventBus[ev.Event] | None = None,
        policy: Policy | None = None,
        check_invariants: bool = False,
    ) -> None:
        self.config = config
        self.state = EngineState(config)
        self.policy = policy or Policy(config)
        self.log = log
        self.bus = bus
        self.check = check_invariants
        self._decisions: list[ev.Event] = []

    def _emit(self, event: ev.Event) -> None:
        self.state.apply(event)
        self._decisions.append(event)

    @property
    def has_work(self) -> bool:
        table = self.state.seqs
        return bool(table.waiting) or table.num_running > 0

    def step(self, inputs: Sequence[ev.Event], clock: float) -> StepResult:
        """Fold the inputs, decide, plan, record. Returns the plan for the executor."""
        self._decisions = []
        step = self.state.step + 1
        self._emit(ev.StepStarted(step, clock))
        for event in inputs:
            self._handle(event)
        if self.state.pending.rows:
            raise ReplayMismatch(f"step {step}: the outcome of step {step - 1} is missing")
        self.policy.schedule(self.state, self._emit)
        plan = plan_step(self.state)
        decisions = tuple(self._decisions)
        inputs = tuple(inputs)
        if self.log is not None:
            self.log.append(encode(StepRecord(step, clock, list(inputs), list(decisions))))
            self.log.flush()  # a crashed process loses at most the record being written
        if self.bus is not None:
            self.bus.publish_many(inputs + decisions)
        if self.check:
            self.state.check_invariants()
        return StepResult(step, plan, inputs, decisions)

    def _handle(self, event: ev.Event) -> None:
        state, policy, emit = self.state, self.policy, self._emit
        if isinstance(event, ev.RequestArrived):
            reason = policy.validate(state, event)
            if reason is not None:
                emit(ev.RequestRejected(event.seq_id, reason))
                return
            state.apply(event)
        elif isinstance(event, ev.StepExecuted):
            state.apply(event)
            policy.publish_checkpoints(state, emit)
            policy.finish_finished(state, event, emit)
        elif isinstance(event, ev.StepFailed):
            state.apply(event)
            policy.abandon_checkpoints(state, emit)
            policy.recover_failed_step(state, event.reason, emit)
        elif isinstance(event, ev.RequestAborted):
            policy.abort(state, event.seq_id, event.reason, emit)
        elif isinstance(event, ev.SessionEnded):
            policy.end_session(state, event.session_id, emit)
        elif isinstance(event, ev.DrainRequested):
            policy.drain(state, emit)
        elif isinstance(event, ev.WakeRequested):
            emit(ev.Woken())
        else:
            state.apply(event)
