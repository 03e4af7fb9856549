"""The engine shell: wires inputs, policy, reducers, plan, log and publishers one step at a time.

    inputs    = validate_inputs(inputs)      validated and ordered; nothing folded on error
    decisions = [StepStarted] + policy(inputs) + policy.schedule(state)
    plan      = plan_step(state)
    log      <- StepRecord(step, clock, inputs, decisions, plan_digest(plan))

A step is transactional towards its caller: an input the engine refuses raises an
``InputError`` before anything is folded (the state stays bit-for-bit unchanged and the
engine keeps serving). A failure after folding began is a bug or a broken invariant: the
engine halts (every later step raises ``EngineHalted``) rather than serve from a state that
no log describes.

The engine never runs the executor: its caller (a driver) does, and feeds the outcome back as
an input of the next step. The engine holds no clock: the caller passes each step's clock.

A caller whose store answers lookups synchronously (vLLM's connectors) may pass a lookup port
to a step: each lookup the policy starts is asked of it at once, and its answer, recorded in
the ``KVLookupStarted`` decision, is folded in the same step (a replay answers from the log).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import msgspec

import kvsched
from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.events.bus import EventBus
from kvsched.events.codec import SCHEMA_VERSION, StepRecord, encode
from kvsched.events.log import EventLog
from kvsched.plan import StepPlan, plan_digest
from kvsched.policy import Policy
from kvsched.policy.common import Emit
from kvsched.reducers.inputs import InputError, MalformedInput, validate_inputs
from kvsched.reducers.planner import plan_step
from kvsched.reducers.state import EngineState

__all__ = [
    "Engine",
    "EngineHalted",
    "InputError",
    "LookupAnswer",
    "LookupPort",
    "RecordSink",
    "StepResult",
    "create_log",
]


# How the policy answers a folded input: (state, input, emit).
Reaction = Callable[[EngineState, Any, Emit], None]


@attrs.frozen
class LookupAnswer:
    """A lookup port's answer: the chain blocks the store holds (``KVLookupAnswered``'s
    ``num_blocks``) and whether their load runs within the step that starts it."""

    num_blocks: int
    sync_load: bool = False


@attrs.frozen
class PrefixProbe:
    """What a request would find cached if it arrived now: ``hit_tokens`` it would be
    served (for a hybrid model, up to its deepest usable state checkpoint) and ``kv_tokens``
    the attention KV alone holds (what a router that follows KV events sees)."""

    hit_tokens: int
    kv_tokens: int


# A step's synchronous answer to a lookup, or None: not known yet (answered later, an input).
LookupPort = Callable[[ev.KVLookupStarted], LookupAnswer | None]


class EngineHalted(RuntimeError):
    """A step failed after folding began; the engine serves no more steps."""


class RecordSink(Protocol):
    """Where each step's encoded record goes besides the log (e.g. a ZMQ publisher)."""

    def publish(self, payload: bytes) -> None: ...


@attrs.frozen
class StepResult:
    step: int
    plan: StepPlan
    inputs: tuple[ev.Event, ...]
    decisions: tuple[ev.Event, ...]


def log_header(config: SchedulerConfig) -> dict[str, object]:
    """The header of a log or stream of a run with this config."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kvsched_version": kvsched.__version__,
        "config": config.to_dict(),
    }


def _good_answer(answer: object) -> bool:
    if not isinstance(answer, LookupAnswer):
        return False
    blocks, sync = answer.num_blocks, answer.sync_load
    return isinstance(sync, bool) and type(blocks) is int and blocks >= 0


def create_log(path: str, config: SchedulerConfig) -> EventLog:
    """Open a new event log for a run with this config (fails before any work is done)."""
    return EventLog.create(
        path,
        schema_version=SCHEMA_VERSION,
        kvsched_version=kvsched.__version__,
        config=config.to_dict(),
    )


def _input_list(inputs: Iterable[ev.Event]) -> list[ev.Event]:
    """``Engine.step``'s inputs that are not a list: any other iterable of events (a tuple, a
    generator, read once) as a list; ``TypeError`` naming what was expected otherwise."""
    if inputs is None or isinstance(inputs, (ev.Event, str, bytes, Mapping)):
        raise TypeError(_NOT_A_LIST.format(type(inputs).__name__))
    try:
        return list(inputs)
    except TypeError:
        raise TypeError(_NOT_A_LIST.format(type(inputs).__name__)) from None


_NOT_A_LIST = (
    "Engine.step(inputs, clock): inputs must be a list of input events "
    "(e.g. [RequestArrived(...)], or [] for none), not {}"
)


class Engine:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        log: EventLog | None = None,
        bus: EventBus[ev.Event] | None = None,
        sinks: Sequence[RecordSink] = (),
        policy: Policy | None = None,
        check_invariants: bool = False,
    ) -> None:
        self.config = config
        self.state = EngineState(config)
        self.policy = policy or Policy(config)
        self.log = log
        self.bus = bus
        self.sinks = list(sinks)
        self.check = check_invariants
        self.halted: BaseException | None = None
        self._decisions: list[ev.Event] = []
        self._reactions = self.reactions()
        self._lookups: LookupPort | None = None  # (the current step's)

    def _emit(self, event: ev.Event) -> None:
        self.state.apply(event)
        self._decisions.append(event)

    def _emit_answering(self, event: ev.Event) -> None:
        """``_emit``, a lookup answered first by the step's lookup port."""
        if type(event) is ev.KVLookupStarted and event.answer < 0 and self._lookups:
            answer = self._lookups(event)
            if answer is not None:
                if not _good_answer(answer):
                    raise ValueError(
                        f"the lookup port answered {answer!r} for sequence {event.seq_id}: "
                        "expected a LookupAnswer of blocks >= 0, or None (answered later)"
                    )
                event = msgspec.structs.replace(
                    event, answer=answer.num_blocks, sync_load=answer.sync_load
                )
        self._emit(event)

    @property
    def has_work(self) -> bool:
        return self.state.has_work

    def probe_prefix(self, request: ev.RequestArrived) -> PrefixProbe:
        """The prefix ``request`` would hit here now (a query: nothing is folded)."""
        state = self.state
        match = self.policy.find_prefix(state, state.seqs.arrival(request).seq)
        kv = match.kv_tokens if match.kv_tokens >= 0 else match.num_tokens
        return PrefixProbe(match.num_tokens, kv)

    def transfers_in_flight(self) -> tuple[list[int], list[int]]:
        """(sequences whose load is in flight, save ids in flight)."""
        transfers = self.state.transfers
        return transfers.in_flight_loads(), sorted(transfers.leases)

    def connector_holds(self) -> list[int]:
        """Sequences whose blocks a connector still sends after their end (``KVHoldRequested``
        until ``KVHoldReleased``)."""
        return sorted(self.state.transfers.holds)

    def step(
        self, inputs: Sequence[ev.Event], clock: float, lookups: LookupPort | None = None
    ) -> StepResult:
        """Check and fold the inputs, decide, plan, record. Returns the plan to execute.
        ``lookups``: the step's lookup port (the module docstring), if any."""
        if self.halted is not None:
            raise EngineHalted(f"the engine halted after an earlier failure: {self.halted}")
        if (
            isinstance(clock, bool)
            or not isinstance(clock, (int, float))
            or not math.isfinite(clock)
        ):
            raise MalformedInput(-1, clock, f"the step clock must be a finite number: {clock!r}")
        items = list(inputs) if isinstance(inputs, list) else _input_list(inputs)
        ordered = validate_inputs(self.state, items)  # (InputError: nothing is folded)
        clock = float(clock)
        try:
            decisions: list[ev.Event] = []
            self._decisions = decisions
            self._lookups = lookups
            emit = self._emit if lookups is None else self._emit_answering
            state, answers = self.state, self._reactions
            step = state.step + 1
            emit(ev.StepStarted(step, clock))
            for event in ordered:
                if isinstance(event, ev.RequestArrived):  # the policy checks it before its fold
                    verdict = self.policy.validate(state, event)
                    if isinstance(verdict, str):
                        emit(ev.RequestRejected(event.seq_id, verdict or "rejected"))
                        continue
                    state.apply(event, verdict)
                else:
                    state.apply(event)
                answer = answers.get(type(event))
                if answer is not None:
                    answer(state, event, emit)
            self.policy.schedule(state, emit)
            self._lookups = None
            plan = plan_step(state)
            if self.log is not None or self.sinks:
                digest = plan_digest(plan, self.config.identity)
                self._record(StepRecord(step, clock, ordered, decisions, digest))
            if self.bus is not None:
                self.bus.publish_many((*ordered, *decisions))
            if self.check:
                state.check_invariants()
        except BaseException as exc:
            self.halted = exc
            raise
        return StepResult(step, plan, tuple(ordered), tuple(decisions))

    def _record(self, record: StepRecord) -> None:
        """Write the step's record to the log (flushed) and to every sink."""
        payload = encode(record)
        if self.log is not None:
            self.log.append(payload)
            self.log.flush()  # a crashed process loses at most the record being written
        for sink in self.sinks:
            sink.publish(payload)

    # ------------------------------------------------------------------- reactions
    # Every input is folded (``EngineState.apply``; an arrival once the policy accepts it),
    # then answered by its reaction, if its type has one (``reactions``).

    def reactions(self) -> dict[type[ev.Event], Reaction]:
        """Input type -> how the policy answers a folded input of that type."""
        return {
            ev.StepExecuted: self.policy.after_executed,
            ev.KVLoadFinished: self._on_load_ended,
            ev.KVLoadFailed: self._on_load_ended,
            ev.StepFailed: self._on_step_failed,
            ev.RequestAborted: self._on_abort,
            ev.SessionEnded: self._on_session_ended,
            ev.DrainRequested: self._on_drain,
            ev.WakeRequested: self._on_wake,
        }

    def _on_load_ended(
        self, state: EngineState, e: ev.KVLoadFinished | ev.KVLoadFailed, emit: Emit
    ) -> None:
        self.policy.settle_load(state, e.seq_id, emit)

    def _on_step_failed(self, state: EngineState, e: ev.StepFailed, emit: Emit) -> None:
        self.policy.after_failed_step(state, e.reason, emit)

    def _on_abort(self, state: EngineState, e: ev.RequestAborted, emit: Emit) -> None:
        self.policy.abort(state, e.seq_id, e.reason, emit)

    def _on_session_ended(self, state: EngineState, e: ev.SessionEnded, emit: Emit) -> None:
        self.policy.end_session(state, e.session_id, emit)

    def _on_drain(self, state: EngineState, e: ev.DrainRequested, emit: Emit) -> None:
        self.policy.drain(state, emit, e.level)

    def _on_wake(self, state: EngineState, e: ev.WakeRequested, emit: Emit) -> None:
        emit(ev.Woken())
