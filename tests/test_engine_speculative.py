"""Speculative decoding in kvsched's own engine: drafts proposed with an outcome, verified by
the next decode (their positions take blocks), rolled back when rejected; the tokens are the
same as without drafts, only the steps change."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

from kvsched.config import ConfigError, ExternalStore, ModelSpec, SchedulerConfig, Speculation
from kvsched.engine import Engine, StepResult, create_log
from kvsched.events import types as ev
from kvsched.events.codec import decode_events, encode
from kvsched.gpu.fingerprint import FingerprintExecutor
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.reducers.inputs import OutcomeMismatch
from kvsched.replay.verify import verify_log

VOCAB = 1000
BS = 4
PLAIN = SchedulerConfig(
    model=ModelSpec(vocab_size=VOCAB, max_context=256),
    block_size=BS,
    num_blocks=60,
    max_batch=4,
    max_prefill_tokens=16,
)
DRAFTS = attrs.evolve(PLAIN, speculation=Speculation(max_drafts=3))
SHARED = list(range(1, 13))  # three blocks every prompt starts with


def workload() -> dict[int, list[ev.Event]]:
    first = [
        ev.RequestArrived(i, np.asarray(SHARED + [50 + i] * (i + 1), np.int32), 10 + i)
        for i in range(4)
    ]
    later = [ev.RequestArrived(9, np.asarray([*SHARED, 7, 7], np.int32), 8)]
    return {1: list(first), 6: list(later)}


Run = list[tuple[StepResult, ev.StepExecuted | None]]


def run(engine: Engine, executor: object, schedule: dict[int, list[ev.Event]]) -> Run:
    """Step until idle: each step's result and its plan's outcome."""
    steps: Run = []
    outcome: list[ev.Event] = []
    for n in range(1, 500):
        if n > max(schedule) and not outcome and not engine.has_work:
            return steps
        result = engine.step([*outcome, *schedule.get(n, [])], float(n))
        executed = None if result.plan.is_empty else executor.execute(result.plan)  # type: ignore[attr-defined]
        steps.append((result, executed))
        outcome = [] if executed is None else [executed]
    raise AssertionError("still busy")


def tokens_by_seq(steps: Run) -> dict[int, list[int]]:
    """Each sequence's tokens as the executor produced them (the engine drops those past a
    sequence's end)."""
    out: dict[int, list[int]] = {}
    for _, o in steps:
        if o is not None:
            counts = o.counts if o.counts is not None else np.ones(len(o.seq_ids), np.int32)
            at = np.concatenate(([0], np.cumsum(counts)))
            for i, seq in enumerate(o.seq_ids.tolist()):
                out.setdefault(seq, []).extend(o.tokens[at[i] : at[i + 1]].tolist())
    return out


def decisions(steps: Run, kind: type) -> list:
    return [d for r, _ in steps for d in r.decisions if isinstance(d, kind)]


@pytest.mark.parametrize("num_blocks", [9, 14, 60], ids=["thrashing", "preempting", "roomy"])
def test_drafts_change_the_steps_and_not_the_tokens_nor_the_kv_read(num_blocks: int):
    plain_config = attrs.evolve(PLAIN, num_blocks=num_blocks)
    plain = FingerprintExecutor(VOCAB, num_blocks, BS)
    base = run(Engine(plain_config, check_invariants=True), plain, workload())
    drafting = FingerprintExecutor(VOCAB, num_blocks, BS, drafts=3, acceptance=0.6)
    config = attrs.evolve(DRAFTS, num_blocks=num_blocks)
    spec = run(Engine(config, check_invariants=True), drafting, workload())

    want, got = tokens_by_seq(base), tokens_by_seq(spec)
    limits = {i: 10 + i for i in range(4)} | {9: 8}
    for seq, tokens in want.items():
        assert got[seq][: limits[seq]] == tokens[: limits[seq]], seq
    assert plain.mismatches == [] and drafting.mismatches == []
    verified = sum(
        int(d.num_drafts.sum())
        for d in decisions(spec, ev.DecodeScheduled)
        if d.num_drafts is not None
    )
    accepted = sum(
        int(o.counts.sum()) - len(o.counts)
        for _, o in spec
        if o is not None and o.counts is not None
    )
    assert 0 < accepted < verified  # some drafts accepted, some rejected
    assert len(spec) < len(base)


def test_the_simulated_executor_produces_the_same_tokens_with_drafts_in_fewer_steps():
    schedule = {
        1: [ev.RequestArrived(i, np.arange(1, 20 + 5 * i, dtype=np.int32), 30) for i in range(3)]
    }
    base = run(Engine(PLAIN, check_invariants=True), SimulatedExecutor(VOCAB), schedule)
    sim = SimulatedExecutor(VOCAB, drafts=3, acceptance=0.8)
    spec = run(Engine(DRAFTS, check_invariants=True), sim, schedule)

    want, got = tokens_by_seq(base), tokens_by_seq(spec)
    assert all(got[s][:30] == want[s][:30] for s in want)
    assert len(spec) < 0.7 * len(base)


def _decoding_engine(
    config: SchedulerConfig = DRAFTS, drafts: tuple[int, ...] = (101, 102, 103), eos: int = -1
) -> tuple[Engine, StepResult]:
    """An engine whose sequence 0 (a 10-token prompt, ``eos``) has sampled token 100 with
    ``drafts`` proposed; returns it and the step that decodes them."""
    engine = Engine(config, check_invariants=True)
    prompt = np.arange(1, 11, dtype=np.int32)
    first = engine.step([ev.RequestArrived(0, prompt, 20, eos_token_id=eos)], 0.0)
    outcome = ev.StepExecuted(
        first.plan.step,
        np.asarray([0]),
        np.asarray([100], np.int32),
        draft_counts=np.asarray([len(drafts)], np.int32),
        drafts=np.asarray(drafts, np.int32),
    )
    return engine, engine.step([outcome], 1.0)


def test_a_decode_verifies_its_drafts_in_positions_that_take_blocks():
    _, step = _decoding_engine()

    (decode,) = decisions([(step, None)], ev.DecodeScheduled)
    assert decode.num_drafts.tolist() == [3]
    plan = step.plan
    assert (plan.starts.tolist(), plan.ends.tolist()) == ([10], [14])
    assert plan.input_ids.tolist() == [100, 101, 102, 103]
    assert plan.num_drafts.tolist() == [3] and plan.sample.tolist() == [True]
    assert plan.num_blocks.tolist() == [4]  # positions 0..13 in blocks of 4
    assert plan.num_decode_tokens == 4


def test_rejected_drafts_roll_back_the_computed_tokens_and_only_known_tokens_are_hashed():
    engine, step = _decoding_engine()
    # two drafts accepted (101, 102), the third rejected: 101, 102 and a new token 7
    outcome = ev.StepExecuted(
        step.plan.step,
        np.asarray([0]),
        np.asarray([101, 102, 7], np.int32),
        counts=np.asarray([3], np.int32),
    )
    engine.step([outcome], 2.0)

    seqs = engine.state.seqs
    row = seqs.seq(0).row
    assert int(seqs.ntokens[row]) == 14  # 10 prompt + 100, 101, 102, 7
    assert int(seqs.computed[row]) == 13  # all but the newest token
    assert len(seqs.seq(0).hashes) == 3  # blocks of known tokens only (12 of 14)


def test_tokens_after_eos_within_accepted_drafts_are_dropped():
    engine, step = _decoding_engine(drafts=(5, 9, 9), eos=5)
    done = ev.StepExecuted(
        step.plan.step,
        np.asarray([0]),
        np.asarray([5, 9, 9], np.int32),
        counts=np.asarray([3], np.int32),
    )
    last = engine.step([done], 2.0)

    (finished,) = decisions([(last, None)], ev.SequenceFinished)
    assert finished.reasons == ("stop",)


def test_an_outcome_with_more_tokens_than_its_drafts_and_one_is_refused():
    engine, step = _decoding_engine()
    too_many = ev.StepExecuted(
        step.plan.step,
        np.asarray([0]),
        np.arange(1, 6, dtype=np.int32),
        counts=np.asarray([5], np.int32),
    )
    with pytest.raises(OutcomeMismatch, match="more tokens than its verified drafts"):
        engine.step([too_many], 2.0)
    bad_drafts = ev.StepExecuted(
        step.plan.step,
        np.asarray([0]),
        np.asarray([1], np.int32),
        draft_counts=np.asarray([2], np.int32),
        drafts=np.asarray([1], np.int32),
    )
    with pytest.raises(OutcomeMismatch, match="draft counts"):
        engine.step([bad_drafts], 2.0)


def test_without_max_drafts_or_with_a_hybrid_model_drafts_are_not_verified():
    for config in (PLAIN, attrs.evolve(DRAFTS, hybrid=True)):
        _, step = _decoding_engine(config)
        (decode,) = decisions([(step, None)], ev.DecodeScheduled)
        assert decode.num_drafts is None and step.plan.ends.tolist() == [11]


def test_drafts_are_verified_no_further_than_the_contexts_last_position():
    config = attrs.evolve(DRAFTS, model=attrs.evolve(DRAFTS.model, max_context=13))
    _, step = _decoding_engine(config)
    (decode,) = decisions([(step, None)], ev.DecodeScheduled)
    assert decode.num_drafts.tolist() == [1] and step.plan.ends.tolist() == [12]


def test_a_logged_run_with_drafts_verifies_with_no_divergence(tmp_path: Path):
    path = tmp_path / "drafts.kvlog"
    log = create_log(str(path), DRAFTS)
    executor = FingerprintExecutor(VOCAB, DRAFTS.num_blocks, BS, drafts=3, acceptance=0.6)
    steps = run(Engine(DRAFTS, log=log), executor, workload())
    log.close()

    result = verify_log(str(path))
    assert result.ok and result.steps == len(steps)
    assert any(d.num_drafts is not None for d in decisions(steps, ev.DecodeScheduled))


def test_an_outcome_event_with_drafts_round_trips_through_the_codec():
    e = ev.StepExecuted(
        3,
        np.asarray([1, 2]),
        np.asarray([4, 5, 6], np.int32),
        counts=np.asarray([2, 1], np.int32),
        draft_counts=np.asarray([1, 0], np.int32),
        drafts=np.asarray([9], np.int32),
    )
    (back,) = decode_events(encode([e]))
    assert isinstance(back, ev.StepExecuted) and back.counts is not None
    assert (
        back.counts.tolist() == [2, 1] and back.drafts is not None and back.draft_counts is not None
    )
    assert back.drafts.tolist() == [9] and back.draft_counts.tolist() == [1, 0]


@pytest.mark.parametrize("drop", [False, True], ids=["lookahead", "eagle"])
def test_an_eagle_drafter_holds_lookahead_blocks_and_its_hits_give_up_their_last_block(
    drop: bool,
):
    """An EAGLE-family drafter writes KV for its own layers past each row's work: every
    plan row's blocks (sent to the executor) cover three lookahead positions past its work,
    up to the context; with ``eagle_block_drop`` a prefix hit gives up its last cached
    block (recomputed for the drafter's hidden states, vLLM's rule). The tokens are those
    of the run without drafts."""
    spec = Speculation(max_drafts=3, lookahead=3, eagle_block_drop=drop)
    config = attrs.evolve(DRAFTS, speculation=spec)
    executor = FingerprintExecutor(VOCAB, config.num_blocks, BS, drafts=3, acceptance=0.6)
    steps = run(Engine(config, check_invariants=True), executor, workload())
    base = run(Engine(PLAIN, check_invariants=True), FingerprintExecutor(VOCAB, 60, BS), workload())

    for result, _ in steps:
        plan = result.plan
        covered = np.minimum(plan.ends + 3, config.model.max_context)
        assert np.all(plan.num_blocks * BS >= covered), result.step
    (late,) = [d for d in decisions(steps, ev.PrefixMatched) if d.seq_id == 9]
    assert late.num_tokens == (8 if drop else 12)  # (12 shared tokens: three blocks)
    want, got = tokens_by_seq(base), tokens_by_seq(steps)
    limits = {i: 10 + i for i in range(4)} | {9: 8}
    for seq, tokens in want.items():
        assert got[seq][: limits[seq]] == tokens[: limits[seq]], seq
    assert executor.mismatches == []


def test_lookahead_slots_are_refused_with_external_kv():
    with pytest.raises(ConfigError, match=r"speculation\.lookahead"):
        attrs.evolve(DRAFTS, speculation=Speculation(max_drafts=3, lookahead=3),
                     external=ExternalStore(enabled=True))
