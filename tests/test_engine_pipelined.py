"""Overlapped steps in kvsched's own engine (``speculation.pipelined``, vLLM's async
scheduling): step N+1 is planned while step N runs, and N's outcome lands one step later.
The tokens are those of the synchronous engine (the executor reads the KV the plans say it
wrote), a token sampled past a sequence's end is dropped, a failure voids the step planned on
it, and the log verifies."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

from kvsched.config import PLACEMENTS, ConfigError, ModelSpec, SchedulerConfig, Speculation
from kvsched.engine import Engine, StepResult, create_log
from kvsched.events import types as ev
from kvsched.gpu.fingerprint import FingerprintExecutor
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.reducers.inputs import OutcomeMismatch
from kvsched.replay.verify import verify_log

VOCAB = 12  # (small: the end-of-sequence token is sampled often)
EOS = 5
BS = 4
SYNC = SchedulerConfig(
    model=ModelSpec(vocab_size=VOCAB, max_context=128),
    block_size=BS,
    num_blocks=60,
    max_batch=4,
    max_prefill_tokens=16,
)
PIPELINED = attrs.evolve(SYNC, speculation=Speculation(pipelined=True))
SHARED = [1, 2, 3, 4, 6, 7, 8, 9, 1, 2, 3, 4]  # three blocks every prompt starts with


def workload() -> dict[int, list[ev.Event]]:
    first = [
        ev.RequestArrived(
            i, np.asarray(SHARED + [6 + i % 4] * (i + 1), np.int32), 6 + 3 * i,
            eos_token_id=EOS if i % 2 else -1,
        )
        for i in range(6)
    ]
    later = [ev.RequestArrived(9, np.asarray([*SHARED, 7, 7], np.int32), 8)]
    return {1: first, 6: later}


Outcome = ev.StepExecuted | ev.StepFailed


class Failing(FingerprintExecutor):
    """Fails the steps whose numbers are in ``fail_at`` (before touching its cache)."""

    def __init__(self, fail_at: set[int], num_blocks: int) -> None:
        super().__init__(VOCAB, num_blocks, BS)
        self.fail_at = fail_at

    def execute(self, plan):  # type: ignore[no-untyped-def]
        if plan.step in self.fail_at:
            self.newest = {}
            raise RuntimeError("injected failure")
        return super().execute(plan)


def run(
    engine: Engine,
    executor: FingerprintExecutor,
    schedule: dict[int, list[ev.Event]],
    lag: int,
    aborts: dict[int, list[ev.Event]] | None = None,
) -> list[tuple[StepResult, Outcome | None]]:
    """Step until idle; each step's outcome is an input ``lag`` steps later (1: the next
    step, as the synchronous engine; 2: the step after next, overlapped)."""
    steps: list[tuple[StepResult, Outcome | None]] = []
    owed: list[Outcome | None] = []
    for n in range(1, 500):
        if n > max(schedule) and not any(owed) and not engine.has_work:
            return steps
        given = owed.pop(0) if len(owed) >= lag else None
        inputs = ([given] if given is not None else []) + schedule.get(n, [])
        result = engine.step(inputs + (aborts or {}).get(n, []), float(n))
        outcome: Outcome | None = None
        if not result.plan.is_empty:
            try:
                outcome = executor.execute(result.plan)
            except RuntimeError as exc:
                outcome = ev.StepFailed(result.plan.step, str(exc))
        steps.append((result, outcome))
        owed.append(outcome)
    raise AssertionError("still busy")


def tokens_at(steps: list[tuple[StepResult, Outcome | None]]) -> dict[int, dict[int, int]]:
    """Each sequence's token at each position it was sampled at; a position sampled twice
    (a recompute) must give the same token (the KV it read was the same). The step after a
    failed one is voided (planned on it): its tokens are not the model's."""
    out: dict[int, dict[int, int]] = {}
    failed = {o.step for _, o in steps if isinstance(o, ev.StepFailed)}
    for result, o in steps:
        if not isinstance(o, ev.StepExecuted) or o.step - 1 in failed:
            continue
        plan = result.plan
        samplers = plan.seq_ids[plan.sample].tolist()
        ends = dict(zip(samplers, plan.ends[plan.sample].tolist(), strict=True))
        for seq, token in zip(o.seq_ids.tolist(), o.tokens.tolist(), strict=True):
            seen = out.setdefault(seq, {})
            assert seen.setdefault(ends[seq], token) == token, (seq, ends[seq])
    return out


def finished(steps: list[tuple[StepResult, Outcome | None]]) -> dict[int, str]:
    return {
        seq: reason
        for r, _ in steps
        for d in r.decisions
        if isinstance(d, ev.SequenceFinished)
        for seq, reason in zip(d.seq_ids.tolist(), d.reasons, strict=True)
    }


def assert_same_tokens(sync: dict[int, dict[int, int]], pipe: dict[int, dict[int, int]]) -> None:
    """Every token the synchronous run produced, the overlapped one produced at the same
    position; it samples at most one position more per sequence (past its end: dropped)."""
    for seq, tokens in sync.items():
        for p, token in tokens.items():
            assert pipe[seq][p] == token, (seq, p)
        assert max(pipe[seq]) <= max(tokens) + 1, seq


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
@pytest.mark.parametrize("num_blocks", [14, 60], ids=["preempting", "roomy"])
def test_overlapped_steps_produce_the_synchronous_engines_tokens(num_blocks: int, hybrid: bool):
    """(hybrid, every placement rule: the fingerprint executor's state slots hold what
    they computed, so a hit restored from a checkpoint not yet written, or from the wrong
    one, or a final state saved after a token dropped past the end of sequence, is a
    mismatch)"""
    cfg = attrs.evolve(SYNC, num_blocks=num_blocks, hybrid=hybrid)
    if hybrid:
        rules = tuple(p for p in PLACEMENTS if p != "oracle")  # (it needs the future)
        every = attrs.evolve(cfg.checkpoints, placement=rules, decode_interval=4)
        cfg = attrs.evolve(cfg, checkpoints=every)
    slots = cfg.num_state_slots if hybrid else 0
    sync_x = FingerprintExecutor(VOCAB, num_blocks, BS, slots)
    pipe_x = FingerprintExecutor(VOCAB, num_blocks, BS, slots)
    sync = run(Engine(cfg, check_invariants=True), sync_x, workload(), lag=1)
    pipe_cfg = attrs.evolve(cfg, speculation=Speculation(pipelined=True))
    pipe = run(Engine(pipe_cfg, check_invariants=True), pipe_x, workload(), lag=2)

    assert_same_tokens(tokens_at(sync), tokens_at(pipe))
    assert finished(pipe) == finished(sync)
    assert "stop" in finished(sync).values() and "length" in finished(sync).values()
    assert sync_x.mismatches == [] and pipe_x.mismatches == []
    hits = [d for r, _ in pipe for d in r.decisions if isinstance(d, ev.PrefixMatched)]
    assert any(d.ckpt_id >= 0 for d in hits) == hybrid  # (restored from a checkpoint)
    overlapped = [r for r, _ in pipe if -1 in r.plan.input_ids]
    assert overlapped, "no step was planned with a placeholder"


def test_a_placeholder_is_decoded_with_input_id_minus_one_before_its_token_is_known():
    engine = Engine(PIPELINED, check_invariants=True)
    prompt = np.arange(1, 7, dtype=np.int32)
    first = engine.step([ev.RequestArrived(0, prompt, 5)], 0.0)
    second = engine.step([], 1.0)  # (the first step's outcome is still out)

    assert first.plan.ends.tolist() == [6] and first.plan.sample.tolist() == [True]
    assert second.plan.starts.tolist() == [6] and second.plan.input_ids.tolist() == [-1]
    outcome = ev.StepExecuted(first.plan.step, np.asarray([0]), np.asarray([9], np.int32))
    third = engine.step([outcome], 2.0)
    assert third.plan.starts.tolist() == [7] and third.plan.input_ids.tolist() == [-1]
    seqs = engine.state.seqs
    assert seqs.num_tokens(seqs.seq(0)) == 7  # the prompt and the token that landed


def test_a_token_sampled_after_the_end_of_sequence_is_dropped():
    engine = Engine(PIPELINED, check_invariants=True)
    prompt = np.arange(1, 7, dtype=np.int32)
    first = engine.step([ev.RequestArrived(0, prompt, 5, eos_token_id=EOS)], 0.0)
    second = engine.step([], 1.0)
    eos = ev.StepExecuted(first.plan.step, np.asarray([0]), np.asarray([EOS], np.int32))
    third = engine.step([eos], 2.0)
    (done,) = [d for d in third.decisions if isinstance(d, ev.SequenceFinished)]
    assert done.reasons == ("stop",) and third.plan.is_empty
    late = ev.StepExecuted(second.plan.step, np.asarray([0]), np.asarray([3], np.int32))
    engine.step([late], 3.0)  # (its sequence ended: the token is dropped)
    assert not engine.has_work


def test_the_last_token_of_max_tokens_is_not_decoded_past():
    engine = Engine(PIPELINED, check_invariants=True)
    first = engine.step([ev.RequestArrived(0, np.arange(1, 7, dtype=np.int32), 2)], 0.0)
    second = engine.step([], 1.0)  # decodes the placeholder: its token is the second
    third = engine.step(
        [ev.StepExecuted(first.plan.step, np.asarray([0]), np.asarray([9], np.int32))], 2.0
    )
    assert not second.plan.is_empty and third.plan.is_empty  # (nothing past max_tokens)


def test_an_outcome_owed_for_two_steps_is_refused():
    engine = Engine(PIPELINED, check_invariants=True)
    engine.step([ev.RequestArrived(0, np.arange(1, 7, dtype=np.int32), 5)], 0.0)
    engine.step([], 1.0)
    with pytest.raises(OutcomeMismatch, match="at the latest in the step after next"):
        engine.step([], 2.0)


def test_a_failed_step_voids_the_step_planned_on_it_and_the_tokens_stay_the_same():
    num_blocks = 60
    sync = run(
        Engine(SYNC, check_invariants=True), FingerprintExecutor(VOCAB, num_blocks, BS),
        workload(), lag=1,
    )
    failing = Failing({5, 9}, num_blocks)  # (step 6, voided, admits sequence 9)
    pipe = run(Engine(PIPELINED, check_invariants=True), failing, workload(), lag=2)

    assert_same_tokens(tokens_at(sync), tokens_at(pipe))
    assert finished(pipe) == finished(sync)
    # (only the voided steps, planned on the failed ones, read KV never written)
    assert {m.split(",")[0] for m in failing.mismatches} <= {"step 6", "step 10"}
    assert sum(isinstance(o, ev.StepFailed) for _, o in pipe) == 2


def test_a_sequence_first_scheduled_in_a_voided_step_recomputes_its_work():
    engine = Engine(PIPELINED, check_invariants=True)
    prompt = np.arange(1, 7, dtype=np.int32)
    first = engine.step([ev.RequestArrived(0, prompt, 5)], 0.0)
    second = engine.step([ev.RequestArrived(1, prompt + 1, 5)], 1.0)
    assert sorted(second.plan.seq_ids.tolist()) == [0, 1]  # (1 is in the voided step only)

    third = engine.step([ev.StepFailed(first.plan.step, "injected")], 2.0)
    void = ev.StepExecuted(
        second.plan.step, np.asarray([0, 1]), np.asarray([9, 9], np.int32)
    )
    fourth = engine.step([void], 3.0)  # (dropped: planned on the failed step)
    assert not any(isinstance(d, ev.SequencePreempted) for d in third.decisions)
    again = dict(zip(third.plan.seq_ids.tolist(), third.plan.starts.tolist(), strict=True))
    assert again == {0: 0, 1: 0}  # both retry their prompts from the start (nothing cached)
    assert sorted(fourth.plan.seq_ids.tolist()) == [0, 1]
    seqs = engine.state.seqs
    assert [seqs.num_tokens(seqs.seq(i)) for i in (0, 1)] == [6, 6]


def test_a_sequence_preempted_while_its_token_is_out_gets_it_before_it_is_readmitted():
    engine = Engine(PIPELINED, check_invariants=True)
    prompt = np.arange(1, 7, dtype=np.int32)
    first = engine.step([ev.RequestArrived(0, prompt, 5, eos_token_id=EOS)], 0.0)
    second = engine.step([], 1.0)  # (decodes the placeholder of the first step's token)
    token = ev.StepExecuted(first.plan.step, np.asarray([0]), np.asarray([9], np.int32))
    drain = [token, ev.DrainRequested(), ev.WakeRequested()]
    third = engine.step(drain, 2.0)  # (the drain preempts it: its second token is still out)

    assert any(isinstance(d, ev.SequencePreempted) for d in third.decisions)
    assert third.plan.is_empty  # (not readmitted while its token is out: vLLM's rule)
    seqs = engine.state.seqs
    eos = ev.StepExecuted(second.plan.step, np.asarray([0]), np.asarray([EOS], np.int32))
    fourth = engine.step([eos], 3.0)
    (done,) = [d for d in fourth.decisions if isinstance(d, ev.SequenceFinished)]
    assert done.seq_ids.tolist() == [0] and done.reasons == ("stop",)  # ended while waiting
    assert fourth.plan.is_empty and seqs.find(0) is None


def test_a_preempted_sequence_resumes_with_the_token_that_landed_in_it():
    engine = Engine(PIPELINED, check_invariants=True)
    prompt = np.arange(1, 7, dtype=np.int32)
    first = engine.step([ev.RequestArrived(0, prompt, 5)], 0.0)
    second = engine.step([], 1.0)
    token = ev.StepExecuted(first.plan.step, np.asarray([0]), np.asarray([9], np.int32))
    engine.step([token, ev.DrainRequested(), ev.WakeRequested()], 2.0)
    late = ev.StepExecuted(second.plan.step, np.asarray([0]), np.asarray([8], np.int32))
    fourth = engine.step([late], 3.0)

    seqs = engine.state.seqs
    assert seqs.seq(0).token_view().tolist() == [*prompt.tolist(), 9, 8]
    assert fourth.plan.seq_ids.tolist() == [0] and fourth.plan.ends.tolist() == [8]


def test_an_abort_while_its_step_runs_drops_its_token():
    engine = Engine(PIPELINED, check_invariants=True)
    first = engine.step([ev.RequestArrived(0, np.arange(1, 7, dtype=np.int32), 5)], 0.0)
    engine.step([ev.RequestAborted(0, "client")], 1.0)
    outcome = ev.StepExecuted(first.plan.step, np.asarray([0]), np.asarray([9], np.int32))
    engine.step([outcome], 2.0)
    assert not engine.has_work and engine.state.seqs.find(0) is None


def test_a_log_of_overlapped_steps_verifies(tmp_path: Path):
    path = str(tmp_path / "pipelined.log")
    log = create_log(path, PIPELINED)
    engine = Engine(PIPELINED, log=log, check_invariants=True)
    run(engine, Failing({7}, PIPELINED.num_blocks), workload(), lag=2)
    log.close()

    result = verify_log(path)
    assert result.ok and result.steps > 10


@pytest.mark.parametrize(
    "other",
    [
        {"model": ModelSpec(vocab_size=VOCAB, routed_experts_per_token=2)},
    ],
    ids=["routed-experts"],
)
def test_overlapped_steps_refuse_what_they_do_not_support_yet(other: dict):
    with pytest.raises(ConfigError, match=r"speculation\.pipelined"):
        attrs.evolve(PIPELINED, **other)


def test_a_hybrid_request_waits_for_a_state_a_step_still_out_saves_and_then_hits_it():
    """b arrives while the step that saves a's state after their shared 16 tokens (a's
    prompt) is out: it waits for that step's outcome (within two steps) rather than
    recompute them, though the step has room for its first chunk."""
    cfg = attrs.evolve(PIPELINED, hybrid=True)
    shared = [1 + i % 10 for i in range(16)]
    a = ev.RequestArrived(0, np.asarray(shared, np.int32), 4)
    b = ev.RequestArrived(1, np.asarray([*shared, 7, 7], np.int32), 4)
    executor = FingerprintExecutor(VOCAB, 60, BS, cfg.num_state_slots)
    steps = run(Engine(cfg, check_invariants=True), executor, {1: [a], 2: [b]}, lag=2)
    hits = {
        d.seq_id: (r.step, d.num_tokens, d.ckpt_id)
        for r, _ in steps
        for d in r.decisions
        if isinstance(d, ev.PrefixMatched)
    }
    admitted_at, hit, ckpt_id = hits[1]
    assert (hit, admitted_at) == (16, 3) and ckpt_id >= 0  # (published in step 3)
    assert executor.mismatches == []


def test_a_decode_time_state_is_saved_one_step_later_and_a_later_request_restores_it():
    """With overlapped steps a decode reaching a block boundary cannot name its state when it
    is planned (its input is a placeholder); the state is saved before the next forward,
    once that token has landed (as vLLM's AsyncScheduler caches the block then). A later
    request continuing the answer restores it, and the fingerprint executor reads the state
    it computed there (a wrong one is a mismatch)."""
    rules = attrs.evolve(
        PIPELINED.checkpoints, placement=("decode_blocks",), aligned_only=True
    )
    cfg = attrs.evolve(
        PIPELINED, hybrid=True, checkpoints=rules, cache_when_planned=True,
        dedup_cached_blocks=False,
    )  # (as under vLLM: blocks cached once their tokens are known and planned)
    prompt = [1 + i % 10 for i in range(6)]
    first = ev.RequestArrived(0, np.asarray(prompt, np.int32), 12)

    def go(schedule: dict[int, list[ev.Event]]) -> tuple[list, FingerprintExecutor]:
        executor = FingerprintExecutor(VOCAB, 60, BS, cfg.num_state_slots)
        return run(Engine(cfg, check_invariants=True), executor, schedule, lag=2), executor

    alone, _ = go({1: [first]})
    answer = prompt + tokens_by_seq(alone)[0][:12]
    later = ev.RequestArrived(1, np.asarray([*answer[:14], 3], np.int32), 2)
    steps, executor = go({1: [first], 30: [later]})

    saves = [d for r, _ in steps for d in r.decisions if isinstance(d, ev.CheckpointReserved)]
    assert {(d.num_tokens, d.phase) for d in saves} == {(8, "before"), (12, "before"),
                                                       (16, "before")}
    (hit,) = [d for r, _ in steps for d in r.decisions
              if isinstance(d, ev.PrefixMatched) and d.seq_id == 1]
    assert hit.num_tokens == 12 and hit.ckpt_id >= 0
    assert executor.mismatches == []


def tokens_by_seq(steps: list[tuple[StepResult, Outcome | None]]) -> dict[int, list[int]]:
    """Each sequence's tokens as the executor produced them, in order (with drafts: the
    accepted ones and one more per step)."""
    out: dict[int, list[int]] = {}
    for _, o in steps:
        if isinstance(o, ev.StepExecuted):
            counts = o.counts if o.counts is not None else np.ones(len(o.seq_ids), np.int32)
            at = np.concatenate(([0], np.cumsum(counts)))
            for i, seq in enumerate(o.seq_ids.tolist()):
                out.setdefault(seq, []).extend(o.tokens[at[i] : at[i + 1]].tolist())
    return out


def kept(seq: int, tokens: list[int]) -> list[int]:
    """The tokens a sequence of ``workload()`` keeps: up to its ``max_tokens`` and its end of
    sequence (what an executor samples past them is dropped)."""
    (arrival,) = [e for es in workload().values() for e in es if e.seq_id == seq]
    out = tokens[: arrival.max_tokens]
    if arrival.eos_token_id in out:
        out = out[: out.index(arrival.eos_token_id) + 1]
    return out


DRAFTING = attrs.evolve(SYNC, speculation=Speculation(max_drafts=2))


@pytest.mark.parametrize("num_blocks", [14, 60], ids=["preempting", "roomy"])
@pytest.mark.parametrize("executor", ["fingerprint", "simulated"])
def test_overlapped_steps_with_drafts_produce_the_synchronous_engines_tokens(
    num_blocks: int, executor: str
):
    """A decode planned while its row's step runs verifies placeholder drafts (input id -1):
    the executor verifies its own proposals, after the tokens it accepted there (the
    rejected drafts move the row's work back, as vLLM's runner does). Every sequence gets
    the synchronous engine's tokens, the fingerprint executor reads the KV the plans say it
    wrote, and drafts are both accepted and rejected."""
    cfg = attrs.evolve(DRAFTING, num_blocks=num_blocks)

    def make() -> FingerprintExecutor | SimulatedExecutor:
        if executor == "fingerprint":
            return FingerprintExecutor(VOCAB, num_blocks, BS, drafts=2, acceptance=0.6)
        return SimulatedExecutor(VOCAB, drafts=2, acceptance=0.6)

    sync_x, pipe_x = make(), make()
    sync = run(Engine(cfg, check_invariants=True), sync_x, workload(), lag=1)
    pipe_cfg = attrs.evolve(cfg, speculation=Speculation(max_drafts=2, pipelined=True))
    pipe = run(Engine(pipe_cfg, check_invariants=True), pipe_x, workload(), lag=2)

    want, got = tokens_by_seq(sync), tokens_by_seq(pipe)
    for seq, tokens in want.items():
        assert kept(seq, got[seq]) == kept(seq, tokens), seq
    assert finished(pipe) == finished(sync)
    if isinstance(pipe_x, FingerprintExecutor):
        assert sync_x.mismatches == [] and pipe_x.mismatches == []  # type: ignore[union-attr]
    blind = [r for r, _ in pipe if len(r.plan.num_drafts) and -1 in r.plan.input_ids]
    assert blind, "no decode verified placeholder drafts"
    counts = [o.counts for _, o in pipe if isinstance(o, ev.StepExecuted) and o.counts is not None]
    verified = sum(int(r.plan.num_drafts.sum()) for r, _ in pipe if len(r.plan.num_drafts))
    accepted = sum(int(c.sum()) - len(c) for c in counts)
    assert 0 < accepted < verified


def test_rejected_drafts_roll_back_and_move_the_next_steps_work_back():
    engine = Engine(attrs.evolve(DRAFTING, speculation=Speculation(max_drafts=2, pipelined=True)))
    prompt = np.arange(1, 7, dtype=np.int32)
    first = engine.step([ev.RequestArrived(0, prompt, 20)], 0.0)
    second = engine.step([], 1.0)  # (the prefill's outcome is out: two placeholder drafts)
    assert second.plan.input_ids.tolist() == [-1, -1, -1]
    assert second.plan.num_drafts.tolist() == [2] and second.plan.starts.tolist() == [6]
    landed = ev.StepExecuted(first.plan.step, np.asarray([0]), np.asarray([9], np.int32))
    third = engine.step([landed], 2.0)
    assert third.plan.starts.tolist() == [9]  # (after the three placeholders of the second)
    one = ev.StepExecuted(
        second.plan.step, np.asarray([0]), np.asarray([4, 5], np.int32),
        counts=np.asarray([2], np.int32),
    )  # (one draft accepted, one rejected)
    fourth = engine.step([one], 3.0)
    seqs = engine.state.seqs
    assert seqs.num_tokens(seqs.seq(0)) == 9  # prompt, 9, 4, 5
    # the third step's work ran one position earlier: its decode started at 8, not 9; its
    # three placeholders are still out, so the fourth starts after them
    assert fourth.plan.starts.tolist() == [11]


def test_a_log_of_overlapped_steps_with_drafts_verifies(tmp_path: Path):
    path = str(tmp_path / "pipelined-drafts.log")
    cfg = attrs.evolve(DRAFTING, speculation=Speculation(max_drafts=2, pipelined=True))
    log = create_log(path, cfg)
    engine = Engine(cfg, log=log, check_invariants=True)
    executor = FingerprintExecutor(VOCAB, cfg.num_blocks, BS, drafts=2, acceptance=0.6)
    run(engine, executor, workload(), lag=2)
    log.close()

    result = verify_log(path)
    assert result.ok and result.steps > 10
