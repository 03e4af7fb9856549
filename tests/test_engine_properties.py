"""Whole-engine property test: a hypothesis state machine drives the engine (fingerprint
executor: its KV and state slots hold prefix hashes, so a hit without its state is seen)
through arrivals with shared prefixes, adapters and salts, steps, executor failures, aborts,
session ends, memory and checkpoint pressure (counted or in bytes), every checkpoint policy,
alternate turns with and without their triggers, decode preallocation, and sleep (at both
levels, the driver putting the executor to sleep and waking it) and wake; every owner's
invariants are checked after every step. Deliberately broken owners must be caught."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tests.mtp_images import IMAGES, SpansWhole, with_image
from tests.overlapped import overlap, step_after_next
from tests.planted import assert_machine_catches
from tests.policy.helpers import preset

from kvsched.config import (
    CHECKPOINT_POLICIES,
    PLACEMENTS,
    ModelSpec,
    Preemption,
    SchedulerConfig,
)
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.events.codec import SCHEMA_VERSION
from kvsched.gpu.fingerprint import FingerprintExecutor
from kvsched.plan import StepPlan
from kvsched.reducers.blocks import BlockPool
from kvsched.reducers.errors import RefChange
from kvsched.reducers.rows import RowTable
from kvsched.reducers.sequences import SequenceTable
from kvsched.replay.driver import execute_step
from kvsched.statemachines import CkptState

VOCAB = 97
PREFIXES = [
    np.arange(1, 1 + n, dtype=np.int32) * (i + 2) % VOCAB + 1 for i, n in enumerate((8, 20, 33))
]


class _Faulty:
    """The executor as the driver runs it, raising when a fault is injected."""

    def __init__(self, inner: FingerprintExecutor) -> None:
        self.inner = inner
        self.fail = False

    def execute(self, plan: StepPlan) -> ev.StepExecuted:
        if self.fail:
            raise RuntimeError("injected fault")
        return self.inner.execute(plan)

    def sleep(self, level: int) -> None:
        self.inner.sleep(level)

    def wake(self) -> None:
        self.inner.wake()


# The engine machines' configuration space (each start draws one).
ENGINE_CONFIGS = dict(
    hybrid=st.booleans(),
    num_blocks=st.integers(10, 40),
    max_batch=st.integers(1, 4),
    chunk_blocks=st.integers(1, 3),
    decode_interval=st.sampled_from([0, 4, 8]),
    budget=st.integers(1, 4),
    turn_mode=st.sampled_from(["mixed", "alternate"]),
    policy=st.sampled_from([*CHECKPOINT_POLICIES, "every rule"]),
    mid_chunk=st.booleans(),
    by_bytes=st.booleans(),
    keep_aborted=st.booleans(),
    session_reclaim=st.sampled_from(["last_use", "session_id"]),
    last_chunk=st.booleans(),
    waiting_tokens=st.booleans(),
    prealloc=st.sampled_from([0, 0, 4, 9]),
    order=st.sampled_from(["fcfs", "priority", "ttft"]),
    max_adapters=st.sampled_from([0, 0, 1]),  # LoRA: 1 keeps two adapters from running at once
)


# What an arrival draws (a shared prefix and suffix, sampling limits, tenant, session).
ARRIVALS = dict(
    prefix=st.integers(0, len(PREFIXES) - 1),
    suffix=st.integers(0, 9),
    max_tokens=st.integers(1, 12),
    adapter=st.sampled_from(["", "lora-a", "lora-b"]),
    salt=st.sampled_from(["", "tenant-b"]),
    priority=st.integers(0, 2),
    session=st.sampled_from([-1, -1, 0, 1]),
)


class EngineMachine(RuleBasedStateMachine):
    """The engine as the system under test; the model is "what has been asked of it"."""

    DEDUP = True  # dedup_cached_blocks (EngineMachineWithPrivateCopies: off, as under vLLM)

    @initialize(**ENGINE_CONFIGS)
    def start(
        self,
        hybrid,
        num_blocks,
        max_batch,
        chunk_blocks,
        decode_interval,
        budget,
        turn_mode,
        policy,
        mid_chunk,
        by_bytes,
        keep_aborted,
        session_reclaim,
        last_chunk,
        waiting_tokens,
        prealloc,
        order,
        max_adapters,
    ):  # type: ignore[no-untyped-def]
        bs = 4
        rules = (
            {"checkpoint_placement": PLACEMENTS, "checkpoint_eviction": "value"}
            if policy == "every rule"
            else preset(policy)
        )
        rules = {"mid_chunk_saves": mid_chunk, **rules}  # (a preset may set it)
        # by_bytes: a state costs 100 bytes, a frozen block 40 more (10 per token)
        memory = {"checkpoint_memory": 100 * budget + 40} if by_bytes else {}
        self.config = SchedulerConfig.from_log_header(
            dict(
                model=ModelSpec(
                    vocab_size=VOCAB,
                    max_context=128,
                    state_bytes=100,
                    kv_bytes_per_token=10,
                    max_adapters=max_adapters,
                ),
                block_size=bs,
                num_blocks=num_blocks,
                max_batch=max_batch,
                max_prefill_tokens=bs * chunk_blocks,
                hybrid=hybrid,
                checkpoint_budget=budget,
                decode_checkpoint_interval=decode_interval,
                turn_mode=turn_mode,
                dedup_cached_blocks=self.DEDUP,
                checkpoint_interval=2 * bs,
                keep_aborted_turns=keep_aborted,  # an aborted session turn stays its history
                session_reclaim=session_reclaim,
                prefill_on_last_chunk=last_chunk,  # alternate turns' triggers
                prefill_on_waiting_tokens=waiting_tokens,
                decode_prealloc_tokens=prealloc,  # 0, 1 or 2 blocks ahead
                order=order,  # ttft: lmdeploy's interleaved prefill turns
                **memory,
                **{"mid_chunk_saves": mid_chunk, **rules},  # a preset's own setting wins
            ),
            SCHEMA_VERSION,
        )
        self.engine = Engine(self.config, check_invariants=True)
        # The fingerprint executor's state slots hold the prefix hash of what they computed:
        # a hit restored without its state (or from the wrong one) is a recorded mismatch.
        self.executor = FingerprintExecutor(
            VOCAB, num_blocks, bs, self.config.num_state_slots if hybrid else 0
        )
        self.runner = _Faulty(self.executor)
        self.outcome: list[ev.Event] = []
        self.inputs: list[ev.Event] = []
        self.next_id = 0
        self.clock = 0.0
        self.drained = False

    def _step(self, fail: bool = False) -> None:
        result = self.engine.step([*self.outcome, *self.inputs], self.clock)
        self.inputs, self.outcome = [], []
        self.clock += 0.01
        self.drained = any(isinstance(d, ev.Drained) for d in result.decisions)
        if self.engine.state.serving.admissions_held:  # (held from this step's inputs on)
            assert not any(isinstance(d, ev.SequenceAdmitted) for d in result.decisions)
        if self.engine.state.serving.running_held and not self.drained:
            assert not len(result.plan.seq_ids)  # (what runs is held: nothing is computed)
        self.runner.fail = fail
        execute_step(self.runner, result, self.outcome, self.clock)  # (sleep and wake too)
        for o in self.outcome:  # only injected faults: never a plan run on a sleeping executor
            assert not isinstance(o, ev.StepFailed) or o.reason.endswith("injected fault"), o

    @rule(**ARRIVALS)
    def arrive(self, prefix, suffix, max_tokens, adapter, salt, priority, session):  # type: ignore[no-untyped-def]
        prompt = np.concatenate([PREFIXES[prefix], np.full(suffix, 5, np.int32)])
        self.inputs.append(
            ev.RequestArrived(
                self.next_id,
                prompt,
                max_tokens,
                arrival_time=self.clock,
                priority=priority,
                session_id=session,
                adapter=adapter,
                cache_salt=salt,
            )
        )
        self.next_id += 1

    @rule()
    def step(self) -> None:
        self._step()

    @rule(n=st.integers(2, 6))
    def run_steps(self, n: int) -> None:
        for _ in range(n):
            self._step()

    @rule()
    def step_whose_executor_raises(self) -> None:
        self._step(fail=True)

    @rule(seq=st.integers(0, 30))
    def abort(self, seq: int) -> None:
        self.inputs.append(ev.RequestAborted(seq))

    @rule(session=st.integers(0, 1))
    def end_session(self, session: int) -> None:
        self.inputs.append(ev.SessionEnded(session))

    @rule(level=st.sampled_from([1, 2]))
    def sleep(self, level: int) -> None:
        self.inputs.append(ev.DrainRequested(level=level))
        self._step()

    @rule()
    def wake(self) -> None:
        self.inputs.append(ev.WakeRequested())

    @rule(held=st.booleans(), running=st.booleans())
    def hold_admissions(self, held: bool, running: bool) -> None:
        self.inputs.append(ev.AdmissionsHeld(held=held, running=running))

    @invariant()
    def owners_are_consistent(self) -> None:
        self.engine.state.check_invariants()

    @invariant()
    def the_executor_sleeps_exactly_while_the_engine_does(self) -> None:
        assert self.executor.sleep_level == self.engine.state.serving.sleep_level

    @invariant()
    def no_hit_is_ever_taken_without_its_state_or_kv(self) -> None:
        assert not self.executor.mismatches, self.executor.mismatches[:3]

    @invariant()
    def after_drain_nothing_is_held(self) -> None:
        state = self.engine.state
        if self.drained:
            assert state.pool.ref.sum() == 0
            assert not state.ckpts.ckpts and not state.pool.index
            assert state.seqs.num_running == 0

    @invariant()
    def pinned_checkpoints_are_pinned_by_running_sequences(self) -> None:
        state = self.engine.state
        for c in state.ckpts.ckpts.values():
            if c.state == CkptState.PINNED:
                users = [s for s in state.seqs.seqs.values() if s.pinned_ckpt == c.ckpt_id]
                assert users and all(s.row >= 0 for s in users)

    def teardown(self) -> None:
        # Wake, lift any hold, finish everything: every request ends, and once sessions end
        # nothing is held.
        self.inputs += [ev.WakeRequested(), ev.AdmissionsHeld(held=False)]
        for _ in range(400):
            if not self.engine.has_work and not self.outcome and not self.inputs:
                break
            self._step()
        assert not self.engine.has_work, "the engine did not finish its work"
        self.inputs = [ev.SessionEnded(0), ev.SessionEnded(1)]
        self._step()
        state = self.engine.state
        held = state.pool.ref.sum() - sum(len(h) for h in state.ckpts.holders())
        assert held == 0, f"{held} block references leaked"
        assert all(c.pins == 0 for c in state.ckpts.ckpts.values())


EngineMachine.TestCase.settings = settings(
    max_examples=max(40, settings.default.max_examples), stateful_step_count=30, deadline=None
)
TestEngineStateMachine = EngineMachine.TestCase


class EngineMachineWithPrivateCopies(EngineMachine):
    """The same machine with ``dedup_cached_blocks`` off (how vLLM runs kvsched)."""

    DEDUP = False


EngineMachineWithPrivateCopies.TestCase.settings = EngineMachine.TestCase.settings
TestEngineStateMachineWithPrivateCopies = EngineMachineWithPrivateCopies.TestCase


def _with_drafts(machine: EngineMachine, **eagle: Any) -> None:
    """The machine's engine and executor again, with three drafts per decode (``eagle``:
    its lookahead and block-drop settings)."""
    speculation = attrs.evolve(machine.config.speculation, max_drafts=3, **eagle)
    machine.config = attrs.evolve(machine.config, speculation=speculation)
    machine.engine = Engine(machine.config, check_invariants=True)
    slots = machine.config.num_state_slots if machine.config.hybrid else 0
    bs, blocks = machine.config.block_size, machine.config.num_blocks
    machine.executor = FingerprintExecutor(VOCAB, blocks, bs, slots, drafts=3)
    machine.runner = _Faulty(machine.executor)


class EngineMachineWithDrafts(EngineMachine):
    """The same machine with speculative decoding: the executor proposes three drafts after
    each sampled token (the tokens it will sample, half of the time), each decode verifies
    them in positions that take blocks, and rejected ones roll back (a hybrid model's drafts
    are not verified). A stale draft's KV read as context is a recorded mismatch."""

    @initialize(**ENGINE_CONFIGS)
    def start(self, **kw) -> None:  # type: ignore[no-untyped-def]
        super().start(**kw)
        _with_drafts(self)


EngineMachineWithDrafts.TestCase.settings = EngineMachine.TestCase.settings
TestEngineStateMachineWithDrafts = EngineMachineWithDrafts.TestCase


class EngineMachinePipelined(EngineMachine):
    """The same machine with overlapped steps (attention and hybrid models): each step's
    outcome is an input of the step after next, so every step is planned while the one
    before runs, with faults, aborts, drains and holds while a step is out. The step after
    a failed one is voided (it was planned on it): only its reads of unwritten KV are
    forgiven."""

    @initialize(**ENGINE_CONFIGS)
    def start(self, **kw) -> None:  # type: ignore[no-untyped-def]
        super().start(**kw)
        _overlap(self)

    def _step(self, fail: bool = False) -> None:
        _overlapped_step(self, super()._step, fail)


def _overlap(machine: EngineMachine) -> None:
    """The machine's engine again, with overlapped steps."""
    overlap(machine)
    machine.failed_steps = set()  # type: ignore[attr-defined]


def _overlapped_step(machine: Any, step: Any, fail: bool) -> None:
    """One step whose outcome is an input of the step after next; the step after a failed
    one is voided (planned on it), so only its reads of unwritten KV are forgiven."""
    step_after_next(machine, lambda: step(fail))
    machine.failed_steps |= {o.step for o in machine.outcome if isinstance(o, ev.StepFailed)}
    machine.executor.mismatches = [
        m for m in machine.executor.mismatches
        if int(m.split()[1].rstrip(",:")) - 1 not in machine.failed_steps
    ]


EngineMachinePipelined.TestCase.settings = EngineMachine.TestCase.settings
TestEngineStateMachinePipelined = EngineMachinePipelined.TestCase


class EngineMachinePipelinedWithDrafts(EngineMachinePipelined):
    """Overlapped steps with speculative decoding (vLLM's AsyncScheduler with drafts): a
    decode planned while its row's step runs verifies placeholder drafts, which the executor
    fills with its own proposals and writes after the tokens it accepted; rejected drafts
    roll back when their outcome lands (a hybrid model's drafts are not verified)."""

    @initialize(**ENGINE_CONFIGS)
    def start(self, **kw) -> None:  # type: ignore[no-untyped-def]
        super().start(**kw)
        _with_drafts(self)


EngineMachinePipelinedWithDrafts.TestCase.settings = EngineMachine.TestCase.settings
TestEngineStateMachinePipelinedWithDrafts = EngineMachinePipelinedWithDrafts.TestCase


class EngineMachineWithMTPAndImages(EngineMachine):
    """The same machine with MTP (a hit's last cached block recomputed privately while the
    sequence holds the cached one) and requests with multimodal spans: no forward starts
    or ends inside one (with or without an encoder budget of 5 positions a step), unless the
    executor keeps a span's encoder output across chunks (``span_slices``, drawn)."""

    @initialize(
        **ENGINE_CONFIGS,
        mtp=st.sampled_from([1, 2]),
        encoder=st.sampled_from([0, 5]),
        slices=st.sampled_from([False, False, True]),
    )
    def start(self, mtp: int, encoder: int = 0, slices: bool = False, **kw) -> None:  # type: ignore[no-untyped-def]
        super().start(**kw)
        speculation = attrs.evolve(self.config.speculation, tokens=mtp)
        model = attrs.evolve(self.config.model, max_encoder_tokens=encoder, span_slices=slices)
        self.config = attrs.evolve(self.config, speculation=speculation, model=model)
        self.engine = Engine(self.config, check_invariants=True)
        if not slices:  # (with span slices a row may start or end inside a span)
            self.executor = SpansWhole(self.executor, self.engine.state)
        self.runner = _Faulty(self.executor)

    @rule(**ARRIVALS, image=IMAGES)
    def arrive(self, image, **kw) -> None:  # type: ignore[no-untyped-def]
        super().arrive(**kw)
        self.inputs[-1] = with_image(self.inputs[-1], image)


EngineMachineWithMTPAndImages.TestCase.settings = EngineMachine.TestCase.settings
TestEngineStateMachineWithMTPAndImages = EngineMachineWithMTPAndImages.TestCase


def _run_broken(
    monkeypatch: pytest.MonkeyPatch, target: object, name: str, broken: object, examples: int = 150
) -> None:
    assert_machine_catches(monkeypatch, EngineMachine, target, name, broken, examples)


def test_a_missing_reference_decrement_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = BlockPool.apply

    def apply_forgetting_the_last(self: BlockPool, change: RefChange) -> None:
        release = tuple(blocks[:-1] if len(blocks) > 1 else blocks for blocks in change.release)
        original(self, change._replace(release=release))

    _run_broken(monkeypatch, BlockPool, "apply", apply_forgetting_the_last)


def test_a_checkpoint_evicted_while_pinned_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvsched.policy.checkpoints import Checkpoints

    def victims_with_pinned(self, state, keep=-1):  # type: ignore[no-untyped-def]
        live = [c for c in state.ckpts.ckpts.values() if c.state != CkptState.RESERVED]
        order = sorted(live, key=lambda c: (c.frozen_block == 0, c.stamp))
        return [(0.0 if self.by_value else None, c) for c in order if c.ckpt_id != keep]

    # Needs checkpoint pressure with a pin in flight: rarer than the other planted bugs.
    _run_broken(monkeypatch, Checkpoints, "ranked_victims", victims_with_pinned, 600)


def test_a_preemption_that_keeps_its_blocks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvsched.policy.growth import Growth

    def preempt_without_release(self, state, seq, emit, reason):  # type: ignore[no-untyped-def]
        emit(ev.SequencePreempted(seq.seq_id, reason))

    _run_broken(monkeypatch, Growth, "preempt", preempt_without_release)


def test_an_eviction_that_lowers_the_aging_floor_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """(Issue 24, rule 2: the floor is monotone across every CheckpointEvicted; the slip sets
    it to the victim's priority, also when the victim is below the floor.)"""
    from kvsched.reducers.checkpoints import CheckpointTable

    original = CheckpointTable._on_dropped

    def dropped_lowering_the_floor(self, e):  # type: ignore[no-untyped-def]
        out = original(self, e)
        if isinstance(e, ev.CheckpointEvicted) and e.priority is not None:
            self.floor = e.priority
        return out

    assert_machine_catches(
        monkeypatch, ValueEvictionMachine, CheckpointTable, "_on_dropped",
        dropped_lowering_the_floor, 300,
    )  # fmt: skip


class ValueEvictionMachine(EngineMachine):
    """The whole-engine machine where the aging floor matters: hybrid, `value` eviction, few
    states (so checkpoints are evicted, some below the floor)."""

    @initialize(
        **{
            **ENGINE_CONFIGS,
            "hybrid": st.just(True),
            "policy": st.sampled_from(["kvsched", "every rule"]),
            "budget": st.integers(1, 2),
            "by_bytes": st.just(False),
        }
    )
    def start(self, **kw):  # type: ignore[no-untyped-def]
        super().start(**kw)


# The configuration kvsched runs inside vLLM (its preset and the rules vLLM's runner keeps).
UNDER_VLLM = {
    **ENGINE_CONFIGS,
    "hybrid": st.booleans(),
    "policy": st.just("vllm-kvsched"),
    "order": st.sampled_from(["fcfs", "priority"]),
    "turn_mode": st.just("mixed"),
    "decode_interval": st.just(0),
    "prealloc": st.just(0),
}


class EngineMachineUnderVllm(EngineMachine):
    """The machine in the configuration kvsched runs inside vLLM (``vllm-kvsched``: aligned
    states, chunk cuts instead of mid-chunk saves, value eviction, blocks cached at planning,
    no dedup, no admission in a step that preempts), with faults: no hit is taken without its
    state or its written KV."""

    DEDUP = False

    @initialize(**UNDER_VLLM)
    def start(self, **kw) -> None:  # type: ignore[no-untyped-def]
        super().start(**kw)
        self.config = attrs.evolve(
            self.config,
            cache_when_planned=True,
            preemption=Preemption(admit_after=False, latest_entered=True),
        )
        self.engine = Engine(self.config, check_invariants=True)


EngineMachineUnderVllm.TestCase.settings = EngineMachine.TestCase.settings
TestEngineStateMachineUnderVllm = EngineMachineUnderVllm.TestCase


class EngineMachineUnderVllmAsync(EngineMachineUnderVllm):
    """The same under vLLM's async scheduling (overlapped steps, each outcome an input of the
    step after next): a hybrid model's decode-time states are saved a step late, once the
    token they hash has landed, and the fingerprint executor's state slots check every
    restore."""

    @initialize(**UNDER_VLLM)
    def start(self, **kw) -> None:  # type: ignore[no-untyped-def]
        super().start(**kw)
        _overlap(self)

    def _step(self, fail: bool = False) -> None:
        _overlapped_step(self, super()._step, fail)


EngineMachineUnderVllmAsync.TestCase.settings = EngineMachine.TestCase.settings
TestEngineStateMachineUnderVllmAsync = EngineMachineUnderVllmAsync.TestCase


class EngineMachineUnderVllmWithEagle(EngineMachineUnderVllm):
    """An EAGLE-family drafter under vLLM's configuration (attention models; steps overlapped
    or not): three drafts per decode, three lookahead positions past each row's work, and a
    prefix hit gives up its last cached block, which the sequence recomputes into a private
    copy (the blocks it computes after the copy stay unindexed: docs/vllm.md)."""

    @initialize(**{**UNDER_VLLM, "hybrid": st.just(False)}, overlapped=st.booleans())
    def start(self, overlapped: bool, **kw) -> None:  # type: ignore[no-untyped-def]
        super().start(**kw)
        if overlapped:
            _overlap(self)
        _with_drafts(self, lookahead=3, eagle_block_drop=True)

    def _step(self, fail: bool = False) -> None:
        if self.config.speculation.pipelined:
            _overlapped_step(self, super()._step, fail)
        else:
            super()._step(fail)


EngineMachineUnderVllmWithEagle.TestCase.settings = EngineMachine.TestCase.settings
TestEngineStateMachineUnderVllmWithEagle = EngineMachineUnderVllmWithEagle.TestCase


def test_drafts_scheduled_without_blocks_for_their_positions_are_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = RowTable.blocks_short

    def short_of_one_token(
        self: RowTable, rows: np.ndarray, drafts: np.ndarray, limit: int
    ) -> np.ndarray:
        return original(self, rows, np.zeros_like(drafts), limit)

    machine = EngineMachineWithDrafts
    assert_machine_catches(monkeypatch, machine, RowTable, "blocks_short", short_of_one_token)


def test_rejected_drafts_left_as_computed_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def never_roll_back(self: SequenceTable, rows: np.ndarray, experts: bool) -> None:
        return None

    machine = EngineMachineWithDrafts
    assert_machine_catches(monkeypatch, machine, SequenceTable, "_settle_drafts", never_roll_back)



# Shrunk falsifying examples of the deep profile, kept as plain tests: the machine, its
# start's settings (beside BASE) and its rules' calls. Each once livelocked or raised.
BASE = dict(
    hybrid=True, num_blocks=10, max_batch=1, chunk_blocks=1, decode_interval=0, budget=1,
    turn_mode="mixed", policy="every rule", mid_chunk=False, by_bytes=False,
    keep_aborted=False, session_reclaim="last_use", last_chunk=False, waiting_tokens=False,
    prealloc=0, order="fcfs", max_adapters=0,
)  # fmt: skip
ARRIVAL = dict(prefix=0, suffix=0, max_tokens=10, adapter="", salt="", priority=0, session=-1)
SHRUNK: dict[str, tuple[type[EngineMachine], dict, list[tuple[str, dict]]]] = {
    # overlapped steps with drafts: the outcome that ended a sequence within its accepted
    # drafts left the step launched after it starting past the tokens kept, and caching
    # then named a block of tokens that were dropped
    "drafts past a sequence's end are not computed": (
        EngineMachinePipelinedWithDrafts, {"hybrid": False, "policy": "kvsched"},
        [("arrive", {"max_tokens": 9, "suffix": 2})] + [("step", {})] * 12,
    ),
    # a sequence-end save planned in a step whose outcome lands two steps later (overlapped
    # steps, an empty step between) was lost, its frozen block held for ever
    "a save whose outcome lands two steps later is published": (
        EngineMachinePipelined, {},
        [("arrive", {}), ("arrive", {"adapter": "lora-a"})],
    ),
    # a partial hit whose pinned frozen tail block left the sequence one block short of its
    # lifetime need: preempted and matched to the same checkpoint again, for ever
    "a partial hit that cannot fit beside its frozen tail is not taken": (
        EngineMachine, {"policy": "kvsched"},
        [("arrive", dict(adapter="lora-a", salt="tenant-b", prefix=1, suffix=s, max_tokens=m))
         for s, m in ((2, 1), (5, 9))],
    ),
    # a token landing in a preempted sequence ended it (overlapped steps): its final state
    # was to be saved from a row it no longer had
    "a preempted sequence that a landing token ends saves no state": (
        EngineMachinePipelined,
        {"max_batch": 3, "chunk_blocks": 2, "policy": "sglang", "order": "ttft"},
        [("arrive", {"max_tokens": 1}), ("arrive", {"max_tokens": 1, "prefix": 1, "suffix": 1}),
         ("abort", {"seq": 0}), ("arrive", {"max_tokens": 4}), ("arrive", {"max_tokens": 2})],
    ),
    # drafts and decode preallocation: a row whose drafts fitted its spare blocks lost them
    # when the spares were given back for room, and was scheduled past its blocks
    "a row's drafts get blocks again once its spares are given back": (
        EngineMachineWithDrafts,
        {"hybrid": False, "num_blocks": 12, "max_batch": 3, "policy": "kvsched",
         "turn_mode": "alternate", "prealloc": 4},
        [("arrive", {"max_tokens": 1, "adapter": "lora-a" if i == 6 else ""})
         for i in range(11)]
        + [("arrive", {"max_tokens": m, "prefix": p}) for m, p in ((8, 1), (1, 0), (4, 0))],
    ),
    # drafts and decode preallocation: an admission that made room gave back, as a spare,
    # the block a decode of the same step had just taken for its drafts (written into the
    # null block)
    "a block this step's drafts write is not a spare": (
        EngineMachineWithDrafts,
        {"hybrid": False, "max_batch": 2, "chunk_blocks": 2, "policy": "kvsched",
         "prealloc": 4},
        [("arrive", {"max_tokens": 5, "suffix": 6}), ("step", {}), ("step", {}),
         ("arrive", {"max_tokens": 1, "prefix": 1}), ("step", {}), ("step", {})],
    ),
    # overlapped steps: a chunk that preempted a victim for its blocks was not run in that
    # step, and a waiting sequence admitted after the preemption took the room, each step
    # in turn (two sequences preempting each other for ever)
    "a chunk that preempted for its blocks runs in the same step": (
        EngineMachinePipelined,
        {"hybrid": False, "max_batch": 3, "chunk_blocks": 2, "policy": "kvsched"},
        [("arrive", dict(zip(("adapter", "max_tokens", "prefix", "priority", "salt",
                              "session", "suffix"), row, strict=True)))
         for row in (("", 6, 0, 0, "", -1, 4), ("lora-b", 3, 1, 2, "", -1, 9),
                     ("lora-b", 8, 0, 0, "tenant-b", 0, 9), ("", 5, 0, 0, "", -1, 7))],
    ),
    # blocks cached at planning: a step failed while its only sequence was aborted, so the
    # failure's recovery (which evicts the unwritten blocks of the step's sequences) missed
    # them, and the next request hit a block never written
    "an aborted sequence's unwritten blocks leave the index when its step fails": (
        EngineMachineUnderVllmAsync,
        {"hybrid": False, "num_blocks": 10, "max_batch": 1, "chunk_blocks": 2,
         "policy": "vllm-kvsched"},
        [("arrive", {"max_tokens": 1}), ("step_whose_executor_raises", {}),
         ("abort", {"seq": 0}), ("arrive", {"max_tokens": 1, "suffix": 1}),
         ("step", {}), ("step", {}), ("step", {})],
    ),
    # hybrid MTP: a partial checkpoint's frozen tail block and the cached block held beside
    # the MTP recompute left the sequence one block short of its whole life after a failed
    # step made it restore that checkpoint (preempted and rematched for ever)
    "a partial hit leaves room for the frozen tail and the MTP overlap block": (
        EngineMachineWithMTPAndImages,
        {"hybrid": True, "chunk_blocks": 2, "policy": "kvsched", "mid_chunk": True, "mtp": 1},
        [("arrive", {"max_tokens": 9, "prefix": 1, "suffix": 1, "image": None})]
        + [("step", {})] * 6
        + [("step_whose_executor_raises", {})],
    ),
    # MTP: a session's second turn whose prompt and max_tokens need every block, and a hit
    # that holds one more (the cached block beside its private recompute): refused now
    "a turn that cannot fit beside its MTP overlap block is refused": (
        EngineMachineWithMTPAndImages,
        {"hybrid": False, "num_blocks": 15, "policy": "kvsched", "mtp": 1},
        [("arrive", {"max_tokens": 12, "session": 0, "suffix": 7, "image": None})]
        + [("step", {})] * 15
        + [("arrive", {"max_tokens": 12, "session": 0, "suffix": 7, "image": None})],
    ),
    # without dedup (as under vLLM): two identical requests filled a block of the same hash
    # in one step, the first one's unindexed (its chain past a private copy), and the second
    # was marked a private copy of a hash cached nowhere
    "a block is a private copy only of an indexed one": (
        EngineMachineUnderVllm,
        {"hybrid": False, "max_batch": 2, "chunk_blocks": 2, "policy": "vllm-kvsched",
         "order": "priority"},
        [("arrive", {"max_tokens": 1, "prefix": 1}),
         ("arrive", {"max_tokens": 5, "salt": "tenant-b", "suffix": 4}),
         ("arrive", {"max_tokens": 5, "salt": "tenant-b", "suffix": 4}),
         ("arrive", {"max_tokens": 5, "priority": 1})],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", SHRUNK)
def test_a_shrunk_example_finishes_its_work_and_leaves_no_reservation(case: str) -> None:
    machine_class, settings_, calls = SHRUNK[case]
    machine = machine_class()
    machine.start(**{**BASE, **settings_})
    machine.step()
    for name, kw in calls:
        getattr(machine, name)(**({**ARRIVAL, **kw} if name == "arrive" else kw))
        machine.owners_are_consistent()
        machine.no_hit_is_ever_taken_without_its_state_or_kv()  # (nor a write past blocks)
    machine.teardown()  # (it asserts that the engine finished its work)
    ckpts = machine.engine.state.ckpts
    assert bool(ckpts.saves) == machine.config.hybrid and not ckpts.awaiting_ids()
    assert all(c.state != CkptState.RESERVED for c in ckpts.ckpts.values())
