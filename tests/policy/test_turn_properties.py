"""Property test of the prefill turns: a hypothesis state machine drives the engine under the
TTFT order with every turn policy (attention and hybrid models, prompts sharing prefixes,
session follow-ups, few rows and small chunks) and checks, independently of the ``Turns``
owner, that a gated turn never runs a long prefill and that the interleaving's count of short
turns never passes its quota; at the end every request has finished (no policy starves a long
prompt) and a second engine fed the same inputs decides the same events (the turns are
recomputed from the stream). Deliberately broken turn rules must be caught."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tests.planted import assert_machine_catches

from kvsched.config import LONG_ORDERS, PREFILL_TURNS, ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.events.codec import encode
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.policy.admission import Admission
from kvsched.policy.turns import PrefillTurns
from kvsched.statemachines import TurnState

VOCAB = 97
BS = 4
PREFIXES = [
    np.arange(1, 1 + n, dtype=np.int32) * (i + 3) % VOCAB + 1 for i, n in enumerate((6, 22))
]


class TurnMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(PREFILL_TURNS),
        quota=st.integers(1, 3),
        long_order=st.sampled_from(LONG_ORDERS),
        hybrid=st.booleans(),
        chunk_blocks=st.integers(1, 3),
        max_batch=st.integers(1, 4),
        num_blocks=st.integers(24, 60),
    )
    def start(self, policy, quota, long_order, hybrid, chunk_blocks, max_batch, num_blocks):  # type: ignore[no-untyped-def]
        self.config = SchedulerConfig.from_dict(
            dict(
                model=ModelSpec(vocab_size=VOCAB, max_context=256),
                block_size=BS,
                num_blocks=num_blocks,
                max_batch=max_batch,
                max_prefill_tokens=BS * chunk_blocks,
                order="ttft",
                prefill_turns=policy,
                # (the quota is an interleave setting: refused with another policy)
                short_turns_per_long=quota if policy == "interleave" else 3,
                long_order=long_order,
                hybrid=hybrid,
                **({"checkpoint_budget": 4} if hybrid else {}),
            )
        )
        self.engine = Engine(self.config, check_invariants=True)
        self.executor = SimulatedExecutor(VOCAB)
        # (inputs, clock, the decisions encoded at once: as the log records them)
        self.steps: list[tuple[list[ev.Event], float, list[bytes]]] = []
        self.outcome: list[ev.Event] = []
        self.inputs: list[ev.Event] = []
        self.next_id = 0
        self.clock = 0.0
        self.turn = self.engine.state.turns.turn  # the model's own view of the turn
        self.short_turns = 0

    def _step(self) -> None:
        inputs = [*self.outcome, *self.inputs]
        result = self.engine.step(inputs, self.clock)
        self.steps.append((inputs, self.clock, [encode(d) for d in result.decisions]))
        self.inputs, self.outcome = [], []
        self.clock += 0.01
        self._check(result.decisions)
        if not result.plan.is_empty:
            self.outcome = [self.executor.execute(result.plan)]

    def _check(self, decisions: tuple[ev.Event, ...]) -> None:
        """Follow the turn from the events alone; a gated turn runs no long prefill."""
        chunk = self.config.chunk_tokens
        for d in decisions:
            if isinstance(d, ev.PrefillTurnChosen):
                self.turn = TurnState[d.turn.upper()]
            elif isinstance(d, ev.PrefillScheduled):
                seqs = self.engine.state.seqs
                starts = zip(d.seq_ids.tolist(), d.starts.tolist(), strict=True)
                left = [seqs.seq(s).n_tokens - a for s, a in starts]
                long = max(left) > chunk
                gated = self.turn in (TurnState.SHORT_ONLY, TurnState.LONG_FIRST_IF_FINAL)
                assert not (gated and long), f"a {self.turn.name} turn ran a long prefill"
                if long:
                    self.short_turns = 0
                elif self.turn == TurnState.SHORT_ONLY:
                    self.short_turns += 1

    @rule(
        prefix=st.integers(-1, len(PREFIXES) - 1),
        suffix=st.integers(1, 40),
        session=st.sampled_from([-1, -1, 0, 1]),
    )
    def arrive(self, prefix: int, suffix: int, session: int) -> None:
        head = PREFIXES[prefix] if prefix >= 0 else np.zeros(0, np.int32)
        prompt = np.concatenate([head, np.full(suffix, 5 + self.next_id % 7, np.int32)])
        self.inputs.append(
            ev.RequestArrived(self.next_id, prompt, 3, arrival_time=self.clock, session_id=session)
        )
        self.next_id += 1

    @rule()
    def step(self) -> None:
        self._step()

    @rule(n=st.integers(2, 6))
    def run_steps(self, n: int) -> None:
        for _ in range(n):
            self._step()

    @invariant()
    def the_turn_is_the_owners_and_the_count_stays_within_the_quota(self) -> None:
        turns = self.engine.state.turns
        assert turns.turn == self.turn
        if self.config.turns.policy == "interleave":
            assert self.short_turns == turns.short_turns <= self.config.turns.short_per_long

    def teardown(self) -> None:
        for _ in range(600):
            if not self.engine.has_work and not self.outcome and not self.inputs:
                break
            self._step()
        assert not self.engine.has_work, "a request was never served"
        # Replay: the same inputs decide the same events (turns included).
        again = Engine(self.config)
        for inputs, clock, decisions in self.steps:
            assert [encode(d) for d in again.step(inputs, clock).decisions] == decisions


TurnMachine.TestCase.settings = settings(
    max_examples=max(30, settings.default.max_examples), stateful_step_count=30, deadline=None
)
TestTurnMachine = TurnMachine.TestCase


def test_a_turn_rule_that_never_makes_the_long_turn_due_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def choose_ignoring_the_quota(self, state, short_work, long_work):  # type: ignore[no-untyped-def]
        if self.policy == "interleave" and long_work and short_work:
            return TurnState.SHORT_ONLY
        return original(self, state, short_work, long_work)

    original = PrefillTurns._choose
    assert_machine_catches(
        monkeypatch, TurnMachine, PrefillTurns, "_choose", choose_ignoring_the_quota, 300
    )


def test_a_gate_that_lets_a_long_prefill_run_on_a_short_turn_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def gate_ignoring_the_turn(self, budget, seq, chunk, held=False):  # type: ignore[no-untyped-def]
        return original(self, attrs.evolve(budget, long_prefills=True), seq, chunk, held)

    original = Admission.refusal
    assert_machine_catches(
        monkeypatch, TurnMachine, Admission, "refusal", gate_ignoring_the_turn, 300
    )
