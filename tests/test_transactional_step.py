"""A step is transactional towards its caller.

An input the engine refuses raises a typed ``InputError`` (``NotAnInput``, ``MalformedInput``,
``OutcomeMismatch``, ``UnknownTransfer``) naming the problem, before anything is folded: the
state is bit-for-bit unchanged, the step counter too, nothing reaches the event log or a sink,
and the engine keeps serving (the same step retried with the right inputs succeeds, the run
finishes and its log verifies with no divergence). A well-formed but unacceptable request is no
input error: the policy answers it with ``RequestRejected``. The inputs of one step are applied
in a fixed order (outcomes, transfer reports, client inputs) whatever order they are given in.
A failure after folding began halts the engine: every later step raises ``EngineHalted``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
from tests.policy.helpers import VOCAB, config, request, tokens

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine, EngineHalted, StepResult, create_log
from kvsched.events import types as ev
from kvsched.events.codec import encode
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.reducers.inputs import (
    InputError,
    MalformedInput,
    NotAnInput,
    OutcomeMismatch,
    UnknownTransfer,
)
from kvsched.replay.verify import verify_log
from kvsched.statemachines import LoadState

EXPERTS_PER_TOKEN = 4
EXT_VOCAB = 97


class Sink:
    """A record sink that keeps every payload it is handed."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def publish(self, payload: bytes) -> None:
        self.payloads.append(payload)


_OWN_CLOCK = object()


class Run:
    """An engine writing an event log, a simulated executor and an event-level KV store,
    stepped by hand: each ``step`` feeds the previous step's outcome first."""

    def __init__(self, path: Path, cfg: SchedulerConfig, executor: SimulatedExecutor | None = None):
        self.path = str(path)
        self.config = cfg
        self.log = create_log(self.path, cfg)
        self.sink = Sink()
        self.engine = Engine(cfg, log=self.log, sinks=[self.sink], check_invariants=True)
        self.executor = executor or SimulatedExecutor(cfg.model.vocab_size)
        self.outcome: list[ev.Event] = []
        self.clock = 0.0

    @property
    def pending(self) -> ev.StepExecuted:
        """The outcome of the step that ran and awaits it."""
        (outcome,) = self.outcome
        assert isinstance(outcome, ev.StepExecuted)
        return outcome

    def step(self, *inputs: ev.Event) -> StepResult:
        return self.step_exactly([*self.outcome, *inputs])

    def step_exactly(self, inputs: list[ev.Event]) -> StepResult:
        """One step given exactly ``inputs`` (the caller supplies the outcome, if any)."""
        result = self.engine.step(inputs, self.clock)
        self.outcome = [] if result.plan.is_empty else [self.executor.execute(result.plan)]
        self.clock += 0.01
        return result

    def refuse(
        self,
        inputs: list[object],
        error: type[InputError],
        match: str,
        clock: object = _OWN_CLOCK,
    ) -> InputError:
        """The step given ``inputs`` raises ``error`` and changes nothing at all."""
        engine = self.engine
        before = engine.state.snapshot()
        step, size, offset = engine.state.step, os.path.getsize(self.path), self.log.offset
        published = len(self.sink.payloads)
        with pytest.raises(error, match=match) as info:
            engine.step(inputs, self.clock if clock is _OWN_CLOCK else clock)  # type: ignore[arg-type]
        assert engine.state.snapshot() == before, "a refused step changed the state"
        assert engine.state.step == step
        assert os.path.getsize(self.path) == size and self.log.offset == offset
        assert len(self.sink.payloads) == published
        assert engine.halted is None, "a refused input halted the engine"
        return info.value

    def owed(self) -> list[ev.Event]:
        """Everything the store owes: lookups answered in full, loads and saves done."""
        transfers = self.engine.state.transfers
        out: list[ev.Event] = []
        for seq_id, load in sorted(transfers.loads.items()):
            if load.state == LoadState.LOOKUP_PENDING:
                out.append(ev.KVLookupAnswered(seq_id, load.num_blocks))
            elif load.in_flight:
                out.append(ev.KVLoadFinished(seq_id))
        return out + [ev.KVSaveFinished(s) for s in sorted(transfers.leases)]

    def finish(self, max_steps: int = 300) -> None:
        """Serve until idle, then check the whole log replays with no divergence."""
        for _ in range(max_steps):
            owed = self.owed()
            if not self.outcome and not owed and not self.engine.has_work:
                break
            self.step(*owed)
        else:
            raise AssertionError("the engine did not become idle")
        self.engine.state.check_invariants()
        assert self.engine.state.seqs.num_running == 0
        self.log.close()
        verified = verify_log(self.path)
        assert verified.ok, verified.divergence.describe()  # type: ignore[union-attr]
        assert verified.steps == self.engine.state.step
        assert verified.torn_tail is None


def with_(event: ev.Event, **changes: object) -> ev.Event:
    return msgspec.structs.replace(event, **changes)


def arrival(seq_id: object = 5, prompt: object = None, max_tokens: object = 3, **kw: object):
    """A request built without any checks (msgspec structs do not validate on construction)."""
    if prompt is None:
        prompt = tokens(8, seed=77)
    return ev.RequestArrived(seq_id, prompt, max_tokens, **kw)  # type: ignore[arg-type]


@pytest.fixture
def run(tmp_path: Path) -> Run:
    """Requests 0 and 1 prefilled in step 1; both sample, and step 1 awaits its outcome."""
    r = Run(tmp_path / "run.kvlog", config())
    r.step(request(0, 8, max_tokens=3), request(1, 12, max_tokens=3))
    assert sorted(r.pending.seq_ids.tolist()) == [0, 1]
    assert r.engine.state.seqs.has_pending and r.engine.state.seqs.pending_step == 1
    return r


# ----------------------------------------------------------------------- NotAnInput

NOT_INPUTS: dict[str, object] = {
    "BlocksAllocated": ev.BlocksAllocated(
        np.array([0], np.int64), np.array([1], np.int32), np.array([3], np.int32)
    ),
    "SequenceFinished": ev.SequenceFinished(np.array([0], np.int64), ("eos",)),
    "StepStarted": ev.StepStarted(2, 0.01),
    "RequestRejected": ev.RequestRejected(5, "no"),
    "a str": "RequestArrived",
    "a dict": {"type": "arrived", "seq_id": 5},
    "None": None,
    "an int": 42,
}


class SneakyArrival(ev.RequestArrived, frozen=True, tag="sneaky"):
    """A subclass of an input type is not an input type: the codec has no tag for it."""


@pytest.mark.parametrize("kind", list(NOT_INPUTS))
def test_a_decision_or_a_non_event_given_as_input_is_refused_as_not_an_input(
    run: Run, kind: str
) -> None:
    bad = NOT_INPUTS[kind]
    err = run.refuse([*run.outcome, bad], NotAnInput, r"input #1 \(\w+\): not an input event")
    assert err.index == 1 and err.event is bad

    run.step()
    run.finish()


def test_a_subclass_of_an_input_type_is_refused_as_not_an_input(run: Run) -> None:
    bad = SneakyArrival(5, tokens(8, seed=5), 3)
    run.refuse([bad, *run.outcome], NotAnInput, r"input #0 \(SneakyArrival\): not an input")

    run.step(request(5, 8))
    run.finish()


def test_an_error_names_the_offending_input_by_its_position_as_given(run: Run) -> None:
    short = with_(run.pending, tokens=run.pending.tokens[:1])
    err = run.refuse([request(5, 8), request(6, 8), short], OutcomeMismatch, r"input #2 ")
    assert err.index == 2 and err.event is short and err.reason == "1 tokens for 2 sequences"

    run.step(request(5, 8), request(6, 8))
    run.finish()


# ------------------------------------------------------------------ OutcomeMismatch

Mutation = Callable[[ev.StepExecuted], list[ev.Event]]

OUTCOME_MISMATCHES: dict[str, tuple[Mutation, str]] = {
    "fewer tokens than seq ids": (
        lambda o: [with_(o, tokens=o.tokens[:1])],
        r"input #0 \(StepExecuted\): 1 tokens for 2 sequences",
    ),
    "more tokens than seq ids": (
        lambda o: [with_(o, tokens=np.append(o.tokens, 1).astype(np.int32))],
        r"3 tokens for 2 sequences",
    ),
    "a duplicated seq id": (
        lambda o: [with_(o, seq_ids=np.repeat(o.seq_ids[:1], 2))],
        r"a sequence id appears twice",
    ),
    "a token equal to vocab_size": (
        lambda o: [with_(o, tokens=np.array([VOCAB, 1], np.int32))],
        r"a sampled token is outside the vocabulary \[0, 1000\)",
    ),
    "a token far above vocab_size": (
        lambda o: [with_(o, tokens=np.array([1, 2**40], np.int64))],
        r"a sampled token is outside the vocabulary",
    ),
    "a negative token": (
        lambda o: [with_(o, tokens=np.array([-1, 1], np.int32))],
        r"a sampled token is outside the vocabulary",
    ),
    "an unknown seq id": (
        lambda o: [with_(o, seq_ids=np.array([0, 7], np.int64))],
        r"sampled ids differ from the sequences that sample \(differ: \[1, 7\]\)",
    ),
    "a sampler left out": (
        lambda o: [with_(o, seq_ids=o.seq_ids[o.seq_ids == 0], tokens=o.tokens[o.seq_ids == 0])],
        r"sampled ids differ from the sequences that sample \(differ: \[1\]\)",
    ),
    "no samplers at all": (
        lambda o: [with_(o, seq_ids=o.seq_ids[:0], tokens=o.tokens[:0])],
        r"differ: \[0, 1\]",
    ),
    "the number of a later step": (
        lambda o: [with_(o, step=2)],
        r"outcome of step 2, but step 1 ran",
    ),
    "the number of an earlier step": (
        lambda o: [with_(o, step=0)],
        r"outcome of step 0, but step 1 ran",
    ),
    "two outcomes": (
        lambda o: [o, with_(o)],
        r"input #1 \(StepExecuted\): no step awaits an outcome \(step 1 given\)",
    ),
    "the same outcome object twice": (
        lambda o: [o, o],
        r"\(StepExecuted\): no step awaits an outcome \(step 1 given\)",
    ),
    "an outcome and a failure": (
        lambda o: [o, ev.StepFailed(1, "oom")],
        r"input #1 \(StepFailed\): no step awaits an outcome",
    ),
    "a failure of the wrong step": (
        lambda o: [ev.StepFailed(2, "oom")],
        r"input #0 \(StepFailed\): outcome of step 2, but step 1 ran",
    ),
    "no outcome": (
        lambda o: [],
        r"input #0 \(NoneType\): the outcome of step 1 \(StepExecuted or StepFailed\) is missing",
    ),
    "no outcome, only a request": (
        lambda o: [request(5, 8)],
        r"input #1 \(NoneType\): the outcome of step 1 .* is missing",
    ),
    "a negative duration": (
        lambda o: [with_(o, duration_s=-0.5)],
        r"duration_s must be finite and >= 0, got -0.5",
    ),
    "routed experts from a model without experts": (
        lambda o: [with_(o, routed_experts=np.zeros(4, np.int16))],
        r"4 routed-expert ids, expected 0 or none",
    ),
}


@pytest.mark.parametrize("case", list(OUTCOME_MISMATCHES))
def test_an_outcome_that_does_not_answer_the_step_that_ran_is_refused_as_a_mismatch(
    run: Run, case: str
) -> None:
    mutate, match = OUTCOME_MISMATCHES[case]
    run.refuse(list(mutate(run.pending)), OutcomeMismatch, match)

    run.step()
    run.finish()


def test_an_outcome_when_no_step_awaits_one_is_refused_as_a_mismatch(run: Run) -> None:
    stale = run.pending
    run.step()
    run.finish()  # closes the log; the engine itself keeps serving
    engine = run.engine
    before, step = engine.state.snapshot(), engine.state.step
    with pytest.raises(OutcomeMismatch, match=r"no step awaits an outcome \(step 1 given\)"):
        engine.step([stale], 9.0)
    with pytest.raises(OutcomeMismatch, match=r"no step awaits an outcome \(step 99 given\)"):
        engine.step([ev.StepFailed(99, "late")], 9.0)
    assert engine.state.snapshot() == before and engine.state.step == step
    assert engine.halted is None


@pytest.mark.parametrize("change", [-1, 1, -EXPERTS_PER_TOKEN])
def test_routed_experts_of_the_wrong_length_are_refused_as_a_mismatch(
    tmp_path: Path, change: int
) -> None:
    model = ModelSpec(vocab_size=VOCAB, max_context=1024, routed_experts_per_token=4)
    executor = SimulatedExecutor(VOCAB, routed_experts_per_token=EXPERTS_PER_TOKEN)
    run = Run(tmp_path / "moe.kvlog", config(model=model), executor)
    run.step(request(0, 8, max_tokens=3, return_routed_experts=True), request(1, 12))
    good = run.pending
    want = (8 + 12) * EXPERTS_PER_TOKEN
    assert len(good.routed_experts) == want
    experts = np.resize(good.routed_experts, want + change).astype(np.int16)

    run.refuse(
        [with_(good, routed_experts=experts)],
        OutcomeMismatch,
        rf"{want + change} routed-expert ids, expected {want} or none",
    )

    run.step()
    run.finish()


# ------------------------------------------------------------------- MalformedInput

SPAN = ev.MultimodalSpan(0, 4, b"img")

CLIENT_MALFORMED: dict[str, tuple[object, str]] = {
    "priority of 2**70": (
        arrival(priority=2**70),
        r"input #1 \(RequestArrived\): priority=1180591620717411303424 does not fit in int64",
    ),
    "priority below int64": (arrival(priority=-(2**63) - 1), r"priority=.* does not fit in int64"),
    "max_tokens of 2**63": (
        arrival(max_tokens=2**63),
        r"max_tokens=9223372036854775808 does not fit in int64",
    ),
    "seed of 2**64": (arrival(seed=2**64), r"seed=18446744073709551616 does not fit in int64"),
    "seq_id of 2**63": (arrival(seq_id=2**63), r"seq_id=9223372036854775808 does not fit"),
    "NaN arrival_time": (arrival(arrival_time=math.nan), r"arrival_time must be finite, got nan"),
    "infinite arrival_time": (
        arrival(arrival_time=math.inf),
        r"arrival_time must be finite, got inf",
    ),
    "NaN temperature": (arrival(temperature=math.nan), r"temperature must be finite, got nan"),
    "string temperature": (arrival(temperature="0.5"), r"temperature must be a number, got str"),
    "a 2-D prompt": (
        arrival(prompt=tokens(8, seed=1).reshape(2, 4)),
        r"prompt must be a 1-D numpy array",
    ),
    "a 0-D prompt": (arrival(prompt=np.array(5, np.int32)), r"prompt must be a 1-D numpy array"),
    "a prompt as a list": (arrival(prompt=[1, 2, 3]), r"prompt must be a 1-D numpy array"),
    "a float prompt": (
        arrival(prompt=tokens(8, seed=1).astype(np.float32)),
        r"prompt must hold integers, not float32",
    ),
    "a bool prompt": (arrival(prompt=np.ones(8, np.bool_)), r"prompt must hold integers, not bool"),
    "seq_id as a str": (arrival(seq_id="5"), r"seq_id must be an integer, got str"),
    "seq_id as a bool": (arrival(seq_id=True), r"seq_id must be an integer, got bool"),
    "seq_id as a float": (arrival(seq_id=5.0), r"seq_id must be an integer, got float"),
    "max_tokens as a float": (arrival(max_tokens=3.0), r"max_tokens must be an integer"),
    "adapter as bytes": (arrival(adapter=b"lora"), r"adapter must be a str"),
    "return_routed_experts as an int": (
        arrival(return_routed_experts=1),
        r"return_routed_experts must be a bool",
    ),
    "mm_spans as a list": (arrival(mm_spans=[SPAN]), r"mm_spans must be a tuple of MultimodalSpan"),
    "an mm span hash as a str": (
        arrival(mm_spans=(ev.MultimodalSpan(0, 4, "img"),)),  # type: ignore[arg-type]
        r"mm_spans.content_hash must be bytes",
    ),
    "an mm span end beyond int64": (
        arrival(mm_spans=(ev.MultimodalSpan(0, 2**64, b"img"),)),
        r"mm_spans.end=18446744073709551616 does not fit in int64",
    ),
    "an abort of a str id": (ev.RequestAborted("0"), r"\(RequestAborted\): seq_id must be an int"),
    "an abort reason that is not a str": (
        ev.RequestAborted(0, None),  # type: ignore[arg-type]
        r"reason must be a str",
    ),
    "a session end of a float id": (
        ev.SessionEnded(1.5),  # type: ignore[arg-type]
        r"\(SessionEnded\): session_id must be an integer, got float",
    ),
}


@pytest.mark.parametrize("case", list(CLIENT_MALFORMED))
def test_a_client_input_the_codec_cannot_encode_or_the_state_cannot_hold_is_malformed(
    run: Run, case: str
) -> None:
    bad, match = CLIENT_MALFORMED[case]
    run.refuse([*run.outcome, bad], MalformedInput, match)

    run.step(request(5, 8))
    run.finish()


OUTCOME_MALFORMED: dict[str, tuple[Mutation, str]] = {
    "float tokens": (
        lambda o: [with_(o, tokens=o.tokens.astype(np.float64))],
        r"\(StepExecuted\): tokens must hold integers, not float64",
    ),
    "2-D seq ids": (
        lambda o: [with_(o, seq_ids=o.seq_ids.reshape(1, -1))],
        r"seq_ids must be a 1-D numpy array",
    ),
    "seq ids as a list": (
        lambda o: [with_(o, seq_ids=o.seq_ids.tolist())],
        r"seq_ids must be a 1-D numpy array",
    ),
    "NaN duration": (
        lambda o: [with_(o, duration_s=math.nan)],
        r"duration_s must be finite, got nan",
    ),
    "infinite duration": (
        lambda o: [with_(o, duration_s=math.inf)],
        r"duration_s must be finite, got inf",
    ),
    "float routed experts": (
        lambda o: [with_(o, routed_experts=np.zeros(4, np.float32))],
        r"routed_experts must hold integers, not float32",
    ),
    "a step number as a str": (lambda o: [with_(o, step="1")], r"step must be an integer, got str"),
    "a failure reason as bytes": (
        lambda o: [ev.StepFailed(1, b"oom")],  # type: ignore[arg-type]
        r"\(StepFailed\): reason must be a str",
    ),
}


@pytest.mark.parametrize("case", list(OUTCOME_MALFORMED))
def test_an_executor_outcome_the_codec_cannot_encode_is_malformed(run: Run, case: str) -> None:
    mutate, match = OUTCOME_MALFORMED[case]
    run.refuse(list(mutate(run.pending)), MalformedInput, match)

    run.step()
    run.finish()


@pytest.mark.parametrize(
    "clock", [math.nan, math.inf, -math.inf, np.float64(math.nan), "0.5", None, True, [0.5]]
)
def test_a_step_clock_that_is_not_a_finite_number_is_malformed(run: Run, clock: object) -> None:
    run.refuse(
        list(run.outcome), MalformedInput, r"the step clock must be a finite number", clock=clock
    )

    run.step()
    run.finish()


# ------------------------------------------------------------------ UnknownTransfer


def external_run(tmp_path: Path, **overrides: object) -> Run:
    base: dict[str, object] = {
        "model": ModelSpec(vocab_size=EXT_VOCAB, max_context=128),
        "block_size": 4,
        "num_blocks": 12,
        "max_batch": 2,
        "max_prefill_tokens": 4,
        "external_kv": True,
    }
    return Run(tmp_path / "external.kvlog", SchedulerConfig.from_dict({**base, **overrides}))  # type: ignore[arg-type]


def _prompt(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def loading(tmp_path: Path) -> Run:
    """Sequence 0 loads chain blocks [0, 2) from the store; sequence 1 waits for its lookup.
    No step awaits an outcome."""
    run = external_run(tmp_path)
    run.step(ev.RequestArrived(0, _prompt(1, 12), 4))
    run.step(ev.KVLookupAnswered(0, 2), ev.RequestArrived(1, _prompt(40, 12), 2))
    assert run.engine.transfers_in_flight() == ([0], [])
    load = run.engine.state.transfers.load_of(1)
    assert load is not None and load.state == LoadState.LOOKUP_PENDING
    assert not run.outcome
    return run


def saving(tmp_path: Path) -> Run:
    """Save 0 of sequence 0 is in flight; sequence 0's load settled; a step awaits its
    outcome."""
    run = external_run(tmp_path, max_batch=1)
    run.step(ev.RequestArrived(0, _prompt(1, 12), 4))
    run.step(ev.KVLookupAnswered(0, 2))
    run.step(ev.KVLoadFinished(0))
    for _ in range(5):
        if run.engine.transfers_in_flight()[1]:
            break
        run.step()
    assert run.engine.transfers_in_flight() == ([], [0])
    assert run.outcome, "a step awaits its outcome"
    return run


Scenario = Callable[[Path], Run]

UNKNOWN_TRANSFERS: dict[str, tuple[Scenario, list[ev.Event], str]] = {
    "a load finished of a sequence that was never looked up": (
        loading,
        [ev.KVLoadFinished(0), ev.KVLoadFinished(7)],
        r"input #1 \(KVLoadFinished\): sequence 7 has no load in flight",
    ),
    "a load failed of a sequence that was never looked up": (
        loading,
        [ev.KVLoadFinished(0), ev.KVLoadFailed(7, 0, "gone")],
        r"input #1 \(KVLoadFailed\): sequence 7 has no load in flight",
    ),
    "a load finished of a sequence whose lookup is unanswered": (
        loading,
        [ev.KVLoadFinished(0), ev.KVLoadFinished(1)],
        r"sequence 1 has no load in flight",
    ),
    "the same load finished twice in one step": (
        loading,
        [ev.KVLoadFinished(0), ev.KVLoadFinished(0)],
        r"input #1 \(KVLoadFinished\): sequence 0 has no load in flight",
    ),
    "a load finished and failed in one step": (
        loading,
        [ev.KVLoadFinished(0), ev.KVLoadFailed(0, 1, "late")],
        r"input #1 \(KVLoadFailed\): sequence 0 has no load in flight",
    ),
    "a save finished while no save is in flight": (
        loading,
        [ev.KVLoadFinished(0), ev.KVSaveFinished(0)],
        r"input #1 \(KVSaveFinished\): save 0 is not in flight",
    ),
    "a load finished of a sequence whose load settled": (
        saving,
        [ev.KVLoadFinished(0)],
        r"sequence 0 has no load in flight",
    ),
    "a load failed of a sequence whose load settled": (
        saving,
        [ev.KVLoadFailed(0, 0, "late")],
        r"sequence 0 has no load in flight",
    ),
    "a save finished of an unknown save id": (
        saving,
        [ev.KVSaveFinished(0), ev.KVSaveFinished(3)],
        r"input #2 \(KVSaveFinished\): save 3 is not in flight",
    ),
    "the same save finished twice in one step": (
        saving,
        [ev.KVSaveFinished(0), ev.KVSaveFinished(0, ok=False)],
        r"input #2 \(KVSaveFinished\): save 0 is not in flight",
    ),
}


@pytest.mark.parametrize("case", list(UNKNOWN_TRANSFERS))
def test_a_transfer_report_for_no_transfer_in_flight_is_refused_as_unknown(
    tmp_path: Path, case: str
) -> None:
    scenario, reports, match = UNKNOWN_TRANSFERS[case]
    run = scenario(tmp_path)
    run.refuse([*run.outcome, *reports], UnknownTransfer, match)

    run.step(*run.owed())
    run.finish()


def test_a_save_reported_again_in_a_later_step_is_refused_as_unknown(tmp_path: Path) -> None:
    run = saving(tmp_path)
    run.step(ev.KVSaveFinished(0))
    assert 0 not in run.engine.transfers_in_flight()[1]
    run.refuse([*run.outcome, ev.KVSaveFinished(0)], UnknownTransfer, r"save 0 is not in flight")

    run.step()
    run.finish()


@pytest.mark.parametrize(
    ("scenario", "report", "match"),
    [
        (loading, ev.KVLoadFailed(0, -1, "bad"), r"\(KVLoadFailed\): num_good_blocks must be >= 0"),
        (loading, ev.KVLookupAnswered(1, -1), r"\(KVLookupAnswered\): num_blocks must be >= 0"),
        (loading, ev.KVLookupAnswered(1, 2**63), r"num_blocks=9223372036854775808 does not fit"),
        (saving, ev.KVSaveFinished(0, ok=1), r"\(KVSaveFinished\): ok must be a bool"),
        (saving, ev.KVSaveFinished("0"), r"save_id must be an integer, got str"),
    ],
    ids=[
        "negative good blocks",
        "negative lookup answer",
        "lookup answer beyond int64",
        "save ok as an int",
        "save id as a str",
    ],
)
def test_a_transfer_report_with_an_impossible_value_is_malformed(
    tmp_path: Path, scenario: Scenario, report: ev.Event, match: str
) -> None:
    run = scenario(tmp_path)
    run.refuse([*run.outcome, report], MalformedInput, match)

    run.step(*run.owed())
    run.finish()


# ------------------------------------------------------------ same-step apply order


def _abort_run(
    tmp_path: Path, name: str, abort_first: bool, max_tokens: int
) -> tuple[Run, StepResult]:
    run = Run(tmp_path / name, config())
    run.step(request(0, 8, max_tokens=max_tokens), request(1, 12, max_tokens=3))
    outcome = run.pending
    abort = ev.RequestAborted(0, "client went away")
    given = [abort, outcome] if abort_first else [outcome, abort]
    result = run.step_exactly(given)
    run.engine.state.check_invariants()
    return run, result


@pytest.mark.parametrize("max_tokens", [3, 1], ids=["abort-takes-effect", "outcome-finishes-it"])
def test_an_abort_given_before_its_sequences_outcome_is_applied_after_it(
    tmp_path: Path, max_tokens: int
) -> None:
    first, got = _abort_run(tmp_path, "abort-first.kvlog", True, max_tokens)
    after, ref = _abort_run(tmp_path, "abort-after.kvlog", False, max_tokens)

    assert [encode(d) for d in got.decisions] == [encode(d) for d in ref.decisions]
    assert [type(e) for e in got.inputs] == [ev.StepExecuted, ev.RequestAborted]
    assert first.engine.state.snapshot() == after.engine.state.snapshot()
    aborted = [d.seq_id for d in got.decisions if isinstance(d, ev.SequenceAborted)]
    finished = [
        s for d in got.decisions if isinstance(d, ev.SequenceFinished) for s in d.seq_ids.tolist()
    ]
    if max_tokens == 1:  # the outcome's token ends it: the abort comes too late to matter
        assert finished == [0] and aborted == []
    else:
        assert aborted == [0] and finished == []
    assert 0 not in first.engine.state.seqs.seqs, "the sequence is still live"
    assert 1 in first.engine.state.seqs.seqs
    assert first.engine.state.seqs.sampling_seq_ids().tolist() == [1]

    first.finish()
    after.finish()
    assert Path(first.path).read_bytes() == Path(after.path).read_bytes()


CLIENT_INPUTS: dict[str, list[ev.Event]] = {
    "an abort": [ev.RequestAborted(0)],
    "an abort of both sequences": [ev.RequestAborted(1), ev.RequestAborted(0)],
    "the same abort twice": [ev.RequestAborted(0), ev.RequestAborted(0)],
    "an abort and a new request of the same id": [ev.RequestAborted(0), request(0, 4)],
    "the end of the running turn's session": [ev.SessionEnded(4)],
    "the end of the session and its next turn": [ev.SessionEnded(4), request(7, 4, session_id=4)],
    "a drain": [ev.DrainRequested()],
    "a drain and a wake": [ev.DrainRequested(), ev.WakeRequested()],
}


@pytest.mark.parametrize("failed", [False, True], ids=["executed", "failed"])
@pytest.mark.parametrize("case", list(CLIENT_INPUTS))
def test_client_inputs_given_before_the_outcome_decide_as_if_given_after_it(
    tmp_path: Path, case: str, failed: bool
) -> None:
    runs = []
    for name, client_first in (("first.kvlog", True), ("after.kvlog", False)):
        run = Run(tmp_path / name, config())
        run.step(request(0, 8, max_tokens=3, session_id=4), request(1, 12, max_tokens=3))
        outcome = ev.StepFailed(1, "device lost") if failed else run.pending
        client = CLIENT_INPUTS[case]
        result = run.step_exactly([*client, outcome] if client_first else [outcome, *client])
        assert [type(e) for e in result.inputs] == [type(outcome), *map(type, client)]
        run.engine.state.check_invariants()
        runs.append((run, result))
    (first, got), (after, ref) = runs

    assert [encode(d) for d in got.decisions] == [encode(d) for d in ref.decisions]
    assert first.engine.state.snapshot() == after.engine.state.snapshot()
    first.finish()
    after.finish()
    assert Path(first.path).read_bytes() == Path(after.path).read_bytes()


@pytest.mark.parametrize(
    "report",
    [ev.KVLoadFinished(0), ev.KVLoadFailed(0, 1, "store lost"), ev.KVLoadFailed(0, 0, "gone")],
    ids=["finished", "failed-keeping-one", "failed-keeping-none"],
)
def test_transfer_reports_given_after_client_inputs_are_applied_before_them(
    tmp_path: Path, report: ev.Event
) -> None:
    (tmp_path / "early").mkdir()
    (tmp_path / "late").mkdir()
    early, late = loading(tmp_path / "early"), loading(tmp_path / "late")
    abort = ev.RequestAborted(0, "client went away")
    got = early.step(abort, report)
    ref = late.step(report, abort)

    assert [type(e) for e in got.inputs] == [type(report), ev.RequestAborted]
    assert [encode(d) for d in got.decisions] == [encode(d) for d in ref.decisions]
    assert any(isinstance(d, ev.SequenceAborted) and d.seq_id == 0 for d in got.decisions)
    assert early.engine.state.snapshot() == late.engine.state.snapshot()
    early.finish()
    late.finish()
    assert Path(early.path).read_bytes() == Path(late.path).read_bytes()


# ---------------------------------------------------- rejected requests are not errors

REJECTED: dict[str, tuple[list[ev.RequestArrived], str]] = {
    "an empty prompt": ([arrival(prompt=np.zeros(0, np.int32))], r"empty prompt"),
    "a token id equal to vocab_size": (
        [arrival(prompt=np.array([5, VOCAB, 7], np.int32))],
        r"token id outside the vocabulary \[0, 1000\)",
    ),
    "a negative token id": (
        [arrival(prompt=np.array([5, -1, 7], np.int32))],
        r"token id outside the vocabulary",
    ),
    "the id of a running sequence": ([request(0, 8)], r"duplicate or invalid request id 0"),
    "an id that arrived earlier in the step": (
        [request(5, 8), request(5, 4)],
        r"duplicate or invalid request id 5",
    ),
    "a negative id": ([request(-3, 8)], r"duplicate or invalid request id -3"),
    "max_tokens zero": ([request(5, 8, max_tokens=0)], r"max_tokens must be positive, got 0"),
    "max_tokens negative": ([request(5, 8, max_tokens=-2)], r"max_tokens must be positive"),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_a_well_formed_but_unacceptable_request_is_rejected_and_the_step_proceeds(
    run: Run, case: str
) -> None:
    requests, reason = REJECTED[case]
    bad = requests[-1]
    step, size = run.engine.state.step, os.path.getsize(run.path)

    result = run.step(*requests)

    assert result.step == step + 1 == run.engine.state.step
    assert os.path.getsize(run.path) > size, "the step was not recorded"
    rejected = [d for d in result.decisions if isinstance(d, ev.RequestRejected)]
    assert len(rejected) == 1 and rejected[0].seq_id == bad.seq_id
    assert re.search(reason, rejected[0].reason), rejected[0].reason
    assert run.engine.state.seqs.pending_step == result.step  # the outcome was folded
    run.finish()


# ------------------------------------------------------------------------------ halt


@pytest.mark.parametrize("method", ["schedule", "after_executed"])
def test_a_failure_after_folding_began_halts_the_engine_for_good(
    run: Run, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    class Planted(RuntimeError):
        pass

    def fail(*args: object, **kwargs: object) -> None:
        raise Planted(f"planted failure in {method}")

    engine, size = run.engine, os.path.getsize(run.path)
    monkeypatch.setattr(engine.policy, method, fail)
    monkeypatch.setattr(engine, "_reactions", engine.reactions())  # (they bind the policy's)
    with pytest.raises(Planted, match="planted failure"):
        engine.step([*run.outcome, request(5, 8)], run.clock)
    assert engine.state.step == 2, "StepStarted was folded before the failure"
    assert isinstance(engine.halted, Planted)
    assert os.path.getsize(run.path) == size, "the failed step was recorded"

    monkeypatch.undo()
    for inputs in ([*run.outcome, request(5, 8)], list(run.outcome), [], [None]):
        with pytest.raises(EngineHalted, match=r"halted after an earlier failure: planted"):
            engine.step(inputs, run.clock + 1)  # type: ignore[arg-type]
    with pytest.raises(EngineHalted):
        engine.step([], math.nan)
    assert engine.state.step == 2

    run.log.close()
    verified = verify_log(run.path)  # what was recorded before the failure still replays
    assert verified.ok and verified.steps == 1


# ------------------------------------------------------------- known gaps (src bugs)

UNENCODABLE: dict[str, Mutation] = {
    "a numpy bool flag of a request": lambda o: [o, arrival(return_routed_experts=np.True_)],
    "a lone surrogate in an adapter name": lambda o: [o, arrival(adapter="\ud800")],
    "a lone surrogate in an abort reason": lambda o: [o, ev.RequestAborted(0, "\udc80")],
    "a lone surrogate in a failure reason": lambda o: [ev.StepFailed(1, "\udc80")],
    "a temperature beyond float32": lambda o: [o, arrival(temperature=1e308)],
}


@pytest.mark.parametrize("case", list(UNENCODABLE))
def test_an_input_the_validation_accepts_is_one_the_codec_can_record(run: Run, case: str) -> None:
    inputs = UNENCODABLE[case](run.pending)
    before = run.engine.state.snapshot()
    try:
        run.step_exactly(inputs)
    except MalformedInput:  # refusing it is as good as recording it
        assert run.engine.state.snapshot() == before
        run.step()
    assert run.engine.halted is None
    run.finish()


@pytest.mark.parametrize("bad", [-1, 40_000])
def test_a_routed_expert_id_outside_int16_is_refused_as_a_mismatch(tmp_path: Path, bad: int):
    model = ModelSpec(vocab_size=VOCAB, max_context=1024, routed_experts_per_token=4)
    executor = SimulatedExecutor(VOCAB, routed_experts_per_token=EXPERTS_PER_TOKEN)
    run = Run(tmp_path / "moe.kvlog", config(model=model), executor)
    run.step(request(0, 8, max_tokens=3, return_routed_experts=True))
    good = run.pending
    experts = good.routed_experts.astype(np.int64)
    experts[3] = bad
    run.refuse([with_(good, routed_experts=experts)], OutcomeMismatch, r"outside \[0, 32767\]")
    run.step()
    run.finish()


def test_the_same_outcome_object_given_twice_is_named_by_its_second_position(run: Run):
    outcome = run.pending
    run.refuse([outcome, outcome], OutcomeMismatch, r"input #1 \(StepExecuted\)")
    run.step()
    run.finish()


def test_inputs_given_as_a_one_shot_iterable_are_all_applied(run: Run):
    result = run.engine.step(iter([run.pending, arrival()]), 1.5)
    assert [type(e).__name__ for e in result.inputs] == ["StepExecuted", "RequestArrived"]
