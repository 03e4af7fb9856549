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
from kvsched.reducers.sequences import Seq
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
        # Sequences this step's transfer decisions concern (kept for the bridge: a sequence
        # may finish, and leave the table, in the step that started its save; its hash chain
        # only ever grows, so the object still answers for the blocks the save names).
        self._transfer_seqs: dict[int, Seq] = {}

    def _emit(self, event: ev.Event) -> None:
        if isinstance(event, (ev.KVSaveStarted, ev.KVLookupStarted)):
            self._transfer_seqs[event.seq_id] = self.state.seq(event.seq_id)
        self.state.apply(event)
        self._decisions.append(event)

    @property
    def has_work(self) -> bool:
        table = self.state.seqs
        transfers = self.state.transfers
        serving = not self.state.sleeping and (bool(table.waiting) or table.num_running > 0)
        return serving or transfers.busy or transfers.drain_pending

    def chain(self, seq_id: int) -> tuple[bytes, tuple[bytes, ...]]:
        """(namespace root, full-block hash chain) of a live sequence: what store keys of its
        blocks are made of (the external-KV bridge asks)."""
        seq = self._transfer_seqs.get(seq_id) or self.state.seq(seq_id)
        return seq.root, tuple(seq.hashes)

    def transfers_in_flight(self) -> tuple[list[int], list[int]]:
        """(sequences whose load is in flight, save ids in flight)."""
        transfers = self.state.transfers
        return transfers.in_flight_loads(), sorted(transfers.leases)

    def step(self, inputs: Sequence[ev.Event], clock: float) -> StepResult:
        """Fold the inputs, decide, plan, record. Returns the plan for the executor."""
        self._decisions = []
        self._transfer_seqs = {}
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
            saving = self.config.external_save and state.hybrid
            reserved = state.reserved_identities() if saving else []
            policy.publish_checkpoints(state, emit)
            policy.start_saves(state, reserved, emit)
            policy.finish_finished(state, event, emit)
        elif isinstance(event, (ev.KVLoadFinished, ev.KVLoadFailed)):
            state.apply(event)
            policy.settle_load(state, event.seq_id, emit)
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
