"""End-to-end engine behaviour: arrival, prefill, decode, finish; the frozen step plan."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import attrs
import msgspec
import numpy as np
import pytest

from kvsched.config import ModelSpec, PrefillTurns, SchedulerConfig
from kvsched.engine import Engine, StepResult
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.plan import StepPlan
from kvsched.replay.driver import run
from kvsched.replay.workload import Turn, Workload

VOCAB = 1000
EOS = 0  # the simulated executor samples tokens in [1, VOCAB): it never emits 0 by itself
CONFIG = SchedulerConfig(
    model=ModelSpec(vocab_size=VOCAB, max_context=1024),
    block_size=16,
    num_blocks=256,
    max_batch=8,
    max_prefill_tokens=64,
)


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, VOCAB, n, dtype=np.int32)


def request(seq_id: int, n_prompt: int, max_tokens: int, **kw: object) -> ev.RequestArrived:
    return ev.RequestArrived(seq_id, prompt(n_prompt, seed=seq_id), max_tokens, **kw)  # type: ignore[arg-type]


class EosAt:
    """The simulated executor, except that it samples ``EOS`` for ``seq_id`` at one position."""

    def __init__(self, at: Mapping[int, int]) -> None:
        self.inner = SimulatedExecutor(VOCAB)
        self.at = dict(at)  # seq_id -> plan end (position) at which EOS is sampled

    def execute(self, plan: StepPlan) -> ev.StepExecuted:
        out = self.inner.execute(plan)
        tokens = out.tokens.copy()
        ends = plan.ends[plan.sample].tolist()
        for i, (seq_id, end) in enumerate(zip(out.seq_ids.tolist(), ends, strict=True)):
            if self.at.get(seq_id) == end:
                tokens[i] = EOS
        return msgspec.structs.replace(out, tokens=tokens)


@attrs.define
class Trace:
    results: list[StepResult]
    outcomes: list[ev.StepExecuted | None]

    def decisions(self, kind: type[ev.Event]) -> list[tuple[int, ev.Event]]:
        return [(r.step, d) for r in self.results for d in r.decisions if isinstance(d, kind)]

    def tokens_of(self, seq_id: int) -> list[int]:
        out: list[int] = []
        for o in self.outcomes:
            if o is not None:
                pairs = zip(o.seq_ids.tolist(), o.tokens.tolist(), strict=True)
                out.extend(t for s, t in pairs if s == seq_id)
        return out

    def finish_reasons(self) -> dict[int, tuple[int, str]]:
        """seq_id -> (step, reason) of every SequenceFinished."""
        found: dict[int, tuple[int, str]] = {}
        for step, d in self.decisions(ev.SequenceFinished):
            assert isinstance(d, ev.SequenceFinished)
            for seq_id, reason in zip(d.seq_ids.tolist(), d.reasons, strict=True):
                assert seq_id not in found, f"sequence {seq_id} finished twice"
                found[seq_id] = (step, reason)
        return found


def drive(
    engine: Engine,
    executor: object,
    schedule: Mapping[int, Sequence[ev.Event]],
    max_steps: int = 1000,
) -> Trace:
    """Step the engine until idle; ``schedule`` maps an engine step to the inputs it gets."""
    trace = Trace([], [])
    outcome: list[ev.Event] = []
    clock = 0.0
    last_input = max(schedule, default=0)
    for n in range(1, max_steps + 1):
        if n > last_input and not outcome and not engine.has_work:
            return trace
        result = engine.step([*outcome, *schedule.get(n, ())], clock)
        assert result.step == n
        trace.results.append(result)
        outcome = []
        executed = None
        if not result.plan.is_empty:
            executed = executor.execute(result.plan)  # type: ignore[attr-defined]
            outcome = [executed]
            clock += executed.duration_s
        trace.outcomes.append(executed)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def new_engine(config: SchedulerConfig = CONFIG) -> Engine:
    return Engine(config, check_invariants=True)


# ------------------------------------------------------------------------ lifecycle


def test_a_request_is_prefilled_in_one_step_then_decoded_one_token_per_step_until_max_tokens():
    engine = new_engine()
    trace = drive(engine, SimulatedExecutor(VOCAB), {1: [request(7, 40, max_tokens=5)]})

    first = trace.results[0]
    kinds = [type(d) for d in first.decisions]
    assert kinds == [
        ev.StepStarted,
        ev.SequenceAdmitted,
        ev.PrefixMatched,
        ev.BlocksAllocated,
        ev.PrefillScheduled,
    ]
    assert first.plan.seq_ids.tolist() == [7]
    assert (first.plan.starts.tolist(), first.plan.ends.tolist()) == ([0], [40])
    assert first.plan.sample.tolist() == [True]
    assert first.plan.input_ids.tolist() == prompt(40, seed=7).tolist()
    assert first.plan.num_prefill_tokens == 40 and first.plan.num_decode_tokens == 0
    # Steps 2-5 decode the positions 40..43 (the 2nd..5th output tokens), one token each.
    for n, result in enumerate(trace.results[1:5], start=2):
        assert [type(d) for d in result.decisions][-1] is ev.DecodeScheduled, n
        assert result.plan.starts.tolist() == [40 + n - 2]
        assert result.plan.num_decode_tokens == 1 and result.plan.num_prefill_tokens == 0
    # Step 6 folds the 5th token and retires the sequence; nothing is left to run.
    assert len(trace.results) == 6
    assert trace.results[-1].plan.is_empty
    assert trace.finish_reasons() == {7: (6, "length")}


def test_a_finished_request_has_generated_exactly_max_tokens_and_released_every_block():
    engine = new_engine()
    trace = drive(engine, SimulatedExecutor(VOCAB), {1: [request(0, 33, max_tokens=9)]})

    assert len(trace.tokens_of(0)) == 9
    assert engine.state.stats.generated_tokens == 9
    assert engine.state.stats.requests_finished == 1
    assert engine.state.seqs.seqs == {}
    assert engine.state.seqs.num_running == 0
    assert int(engine.state.pool.ref.sum()) == 0
    assert engine.state.pool.num_available == CONFIG.num_blocks - 1  # all but the null block


def test_max_tokens_one_finishes_right_after_the_prefill_without_any_decode_step():
    engine = new_engine()
    trace = drive(engine, SimulatedExecutor(VOCAB), {1: [request(3, 20, max_tokens=1)]})

    assert trace.decisions(ev.DecodeScheduled) == []
    assert trace.finish_reasons() == {3: (2, "length")}
    assert len(trace.tokens_of(3)) == 1


def test_a_prompt_longer_than_the_chunk_is_prefilled_in_canonical_chunks_sampling_only_at_the_end():
    engine = new_engine()
    trace = drive(engine, SimulatedExecutor(VOCAB), {1: [request(0, 150, max_tokens=2)]})

    prefills = [r.plan for r in trace.results[:3]]
    assert [(p.starts.tolist(), p.ends.tolist()) for p in prefills] == [
        ([0], [64]),
        ([64], [128]),
        ([128], [150]),
    ]
    assert [p.sample.tolist() for p in prefills] == [[False], [False], [True]]
    assert np.concatenate([p.input_ids for p in prefills]).tolist() == prompt(150, 0).tolist()
    assert trace.finish_reasons() == {0: (5, "length")}
    assert len(trace.tokens_of(0)) == 2


def test_many_requests_each_generate_max_tokens_and_finish_with_reason_length():
    rng = np.random.default_rng(1)
    turns = []
    for i in range(12):
        req = request(i, int(rng.integers(1, 200)), max_tokens=int(rng.integers(1, 30)))
        turns.append(Turn(req, arrival_s=float(rng.uniform(0.0, 0.05))))
    engine = new_engine()
    results: list[StepResult] = []
    workload = Workload("w", tuple(turns))
    summary = run(engine, SimulatedExecutor(VOCAB), workload, on_step=results.append)

    generated: Counter[int] = Counter()
    reasons: dict[int, str] = {}
    for r in results:
        for e in r.inputs:
            if isinstance(e, ev.StepExecuted):
                generated.update(e.seq_ids.tolist())
        for d in r.decisions:
            if isinstance(d, ev.SequenceFinished):
                reasons.update(zip(d.seq_ids.tolist(), d.reasons, strict=True))
    assert reasons == {t.request.seq_id: "length" for t in turns}
    assert dict(generated) == {t.request.seq_id: t.request.max_tokens for t in turns}
    assert summary.finished == 12 and summary.rejected == 0
    assert summary.generated_tokens == sum(t.request.max_tokens for t in turns)
    assert int(engine.state.pool.ref.sum()) == 0


def test_sampling_the_eos_token_finishes_with_reason_stop_and_eos_as_the_last_token():
    engine = new_engine()
    # Sequence 0 (prompt 20) samples EOS as its 4th output token (position 20 + 3).
    schedule = {
        1: [
            request(0, 20, max_tokens=50, eos_token_id=EOS),
            request(1, 20, max_tokens=6, eos_token_id=EOS),
        ]
    }
    trace = drive(engine, EosAt({0: 23}), schedule)

    assert trace.finish_reasons() == {0: (5, "stop"), 1: (7, "length")}
    assert trace.tokens_of(0)[-1] == EOS
    assert len(trace.tokens_of(0)) == 4
    assert len(trace.tokens_of(1)) == 6
    assert EOS not in trace.tokens_of(1)


def test_the_eos_token_does_not_stop_a_request_that_has_no_eos_token_id():
    engine = new_engine()
    trace = drive(engine, EosAt({0: 23}), {1: [request(0, 20, max_tokens=8)]})

    assert trace.tokens_of(0)[3] == EOS
    assert trace.finish_reasons() == {0: (9, "length")}
    assert len(trace.tokens_of(0)) == 8


# ------------------------------------------------------------------------ StepPlan

ARRAY_FIELDS = [f.name for f in attrs.fields(StepPlan) if f.type in ("np.ndarray", np.ndarray)]
assert {"seq_ids", "input_ids", "slot_mapping", "block_tables", "sample"} <= set(ARRAY_FIELDS)


def first_plan() -> StepPlan:
    engine = new_engine()
    return engine.step([request(0, 40, 4), request(1, 100, 4)], 0.0).plan


def test_step_plan_fields_cannot_be_reassigned():
    plan = first_plan()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.step = 99  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.input_ids = np.zeros(1, np.int32)  # type: ignore[misc]


def test_every_step_plan_array_is_read_only():
    plan = first_plan()
    fields = attrs.fields(StepPlan)
    arrays = {f.name for f in fields if isinstance(getattr(plan, f.name), np.ndarray)}
    assert arrays == set(ARRAY_FIELDS)
    for name in ARRAY_FIELDS:
        arr = getattr(plan, name)
        assert not arr.flags.writeable, name
        if arr.size:
            with pytest.raises(ValueError, match="read-only"):
                arr.reshape(-1)[0] = 1


def test_a_step_plan_is_not_changed_by_later_steps():
    engine = new_engine()
    executor = SimulatedExecutor(VOCAB)
    result = engine.step([request(0, 70, 6), request(1, 10, 6)], 0.0)
    kept = {name: getattr(result.plan, name).copy() for name in ARRAY_FIELDS}
    outcome = executor.execute(result.plan)
    for n in range(2, 10):
        plan = engine.step([outcome], float(n)).plan
        if plan.is_empty:
            break
        outcome = executor.execute(plan)
    for name, before in kept.items():
        assert np.array_equal(getattr(result.plan, name), before), name


# ------------------------------------------------------------------ known policy bug


def test_alternate_turn_mode_keeps_decoding_when_the_batch_is_full():
    turns = PrefillTurns(mode="alternate", prefill_interval=1)
    config = attrs.evolve(CONFIG, max_batch=1, turns=turns)
    engine = new_engine(config)
    schedule = {1: [request(0, 8, max_tokens=4), request(1, 8, max_tokens=4)]}

    trace = drive(engine, SimulatedExecutor(VOCAB), schedule, max_steps=100)

    assert {s: r for s, (_, r) in trace.finish_reasons().items()} == {0: "length", 1: "length"}


@pytest.mark.parametrize(
    "inputs",
    [None, 5, "RequestArrived", b"\x00", {}, ev.WakeRequested()],
    ids=["None", "int", "str", "bytes", "dict", "one event"],
)
def test_step_refuses_inputs_that_are_not_a_list_of_events_naming_what_it_expects(
    inputs: object,
) -> None:
    engine = Engine(CONFIG)
    with pytest.raises(TypeError, match=r"inputs must be a list of input events .* not "):
        engine.step(inputs, 0.0)  # type: ignore[arg-type]
    assert engine.halted is None and engine.state.step == 0  # refused before anything folded
    assert engine.step((request(1, 8, 2),), 0.0).step == 1  # any other iterable still works


def test_each_input_is_answered_by_its_reaction_or_only_folded() -> None:
    """The engine's reactions are a table (input type -> reaction), like the owners' folds:
    every input without one is folded, and every input no owner folds has one."""
    from kvsched.reducers.state import STATELESS_INPUTS

    engine = Engine(SchedulerConfig(model=ModelSpec(vocab_size=100, max_context=256)))
    reactions = engine.reactions()
    assert set(reactions) <= set(ev.INPUT_TYPES)
    assert set(STATELESS_INPUTS) <= set(reactions)
    engine.step([ev.WakeRequested()], 0.0)
    assert [type(d) for d in engine.step([ev.WakeRequested()], 1.0).decisions][-1] is ev.Woken
