"""A step's lookup port (``Engine.step(lookups=...)``): a store that answers lookups
synchronously (vLLM's connectors) answers each lookup the policy starts within its step, so
the sequence is admitted (to load, or to compute after a miss) in the step that looked it up,
as vLLM's scheduler does; the answer is recorded in the ``KVLookupStarted`` decision and a
replay answers from it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from tests.policy.helpers import config, of_type

from kvsched.engine import Engine, EngineHalted, LookupAnswer, create_log
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.replay.verify import verify_log


def _prompt(seq_id: int, n: int = 100) -> np.ndarray:
    return np.random.default_rng(seq_id).integers(1, 200, n, dtype=np.int32)


class _Run:
    """An engine with an external store and a simulated executor, stepped with a port."""

    def __init__(self, log: str | None = None, **overrides: object) -> None:
        self.config = config(external_kv=True, max_prefill_tokens=256, **overrides)
        self.log = create_log(log, self.config) if log else None
        self.engine = Engine(self.config, log=self.log, check_invariants=True)
        self.executor = SimulatedExecutor(self.config.model.vocab_size)
        self.outcome: list[ev.Event] = []
        self.asked: list[ev.KVLookupStarted] = []

    def step(
        self, inputs: list[ev.Event], port: Callable[[ev.KVLookupStarted], object] | None
    ) -> tuple[ev.Event, ...]:
        def ask(e: ev.KVLookupStarted) -> LookupAnswer | None:
            self.asked.append(e)
            answer = port(e) if port else None
            return LookupAnswer(answer) if type(answer) is int else answer  # type: ignore[return-value]

        result = self.engine.step([*self.outcome, *inputs], 0.0, ask if port else None)
        self.outcome = [] if result.plan.is_empty else [self.executor.execute(result.plan)]
        return result.decisions

    def loads_reported(self) -> list[ev.Event]:
        return [ev.KVLoadFinished(s) for s in self.engine.state.transfers.in_flight_loads()]


def test_a_lookup_answered_in_its_step_admits_the_sequence_to_load_in_that_step():
    run = _Run()
    decisions = run.step([ev.RequestArrived(1, _prompt(1), 2)], lambda e: e.num_blocks)
    (started,) = of_type(decisions, ev.KVLookupStarted)
    assert (started.first_block, started.answer) == (0, started.num_blocks) == (0, 6)
    (load,) = of_type(decisions, ev.KVLoadStarted)
    assert load.seq_id == 1 and len(load.blocks) == 6
    assert run.asked == [ev.KVLookupStarted(**{**_fields(started), "answer": -1})]


def test_a_miss_answered_in_its_step_computes_the_prompt_in_that_step():
    run = _Run()
    decisions = run.step([ev.RequestArrived(1, _prompt(1), 2)], lambda e: e.first_block)
    assert [d.seq_id for d in of_type(decisions, ev.SequenceAdmitted)] == [1]
    assert of_type(decisions, ev.PrefillScheduled) and not of_type(decisions, ev.KVLoadStarted)


def test_a_port_that_does_not_know_yet_leaves_the_lookup_to_a_later_input():
    run = _Run()
    decisions = run.step([ev.RequestArrived(1, _prompt(1), 2)], lambda e: None)
    assert of_type(decisions, ev.KVLookupStarted)[0].answer == -1
    assert not of_type(decisions, ev.SequenceAdmitted)
    decisions = run.step([ev.KVLookupAnswered(1, 3)], lambda e: None)
    (load,) = of_type(decisions, ev.KVLoadStarted)
    assert len(load.blocks) == 3


def test_a_log_of_lookups_answered_in_their_steps_verifies(tmp_path):
    """The replay answers each lookup from its recorded decision (without the recorded
    answers it would admit nothing in those steps, and diverge)."""
    path = str(tmp_path / "port.kvlog")
    run = _Run(path)
    depth = {1: 6, 2: 0, 3: 2, 4: 5}  # blocks the store holds, per sequence (4: synchronous)
    arrivals = [ev.RequestArrived(s, _prompt(s), 3) for s in depth]
    run.step(arrivals, lambda e: LookupAnswer(depth[e.seq_id], sync_load=e.seq_id == 4))
    for _ in range(12):
        run.step(run.loads_reported(), lambda e: None)
    assert run.log is not None
    run.log.close()
    assert {e.seq_id for e in run.asked} == set(depth)
    result = verify_log(path)
    assert result.ok and result.steps == 13, result.divergence


@pytest.mark.parametrize("bad", [-1, True, 2.5, LookupAnswer(-1), LookupAnswer(2, 1)])
def test_a_port_answer_that_is_not_a_block_count_is_a_clear_error(bad):
    run = _Run()
    with pytest.raises(ValueError, match=r"lookup port answered .* for sequence 1"):
        run.step([ev.RequestArrived(1, _prompt(1), 2)], lambda e: bad)
    with pytest.raises(EngineHalted):
        run.step([], None)


def test_a_synchronous_load_answered_in_its_step_runs_its_sequence_in_that_step():
    """vLLM's synchronous connectors load before the forward of the step that schedules the
    request: the load ends when it starts, the sequence is settled into a row and its first
    chunk (past the loaded blocks) runs in that step; its loaded blocks are cached then."""
    run = _Run()
    sync = lambda e: LookupAnswer(4, sync_load=True)  # noqa: E731
    decisions = run.step([ev.RequestArrived(1, _prompt(1), 2)], sync)
    (started,) = of_type(decisions, ev.KVLookupStarted)
    assert (started.answer, started.sync_load) == (4, True)
    (load,) = of_type(decisions, ev.KVLoadStarted)
    assert load.synchronous and len(load.blocks) == 4
    (settled,) = of_type(decisions, ev.KVLoadSettled)
    assert settled.num_blocks == 4 and settled.row >= 0
    chunks = of_type(decisions, ev.PrefillScheduled)
    assert [(d.seq_ids.tolist(), d.starts.tolist()) for d in chunks] == [([1], [64])]
    assert run.engine.state.transfers.in_flight_loads() == []


def test_a_synchronous_load_without_a_free_row_settles_when_one_frees(tmp_path):
    path = str(tmp_path / "sync.kvlog")
    run = _Run(path, max_batch=1)
    run.step([ev.RequestArrived(1, _prompt(1, 40), 3)], lambda e: 0)  # a miss: runs
    decisions = run.step(
        [ev.RequestArrived(2, _prompt(2), 2)], lambda e: LookupAnswer(4, sync_load=True)
    )
    assert of_type(decisions, ev.KVLoadStarted) and not of_type(decisions, ev.KVLoadSettled)
    settled = []
    for _ in range(8):
        settled += of_type(run.step([], None), ev.KVLoadSettled)
    assert [s.seq_id for s in settled] == [2]
    assert run.log is not None
    run.log.close()
    assert verify_log(path).ok


def test_an_input_answer_may_make_a_load_synchronous_too():
    run = _Run()
    run.step([ev.RequestArrived(1, _prompt(1), 2)], None)
    decisions = run.step([ev.KVLookupAnswered(1, 3, sync_load=True)], None)
    (load,) = of_type(decisions, ev.KVLoadStarted)
    assert load.synchronous and of_type(decisions, ev.KVLoadSettled)


def _fields(e: ev.KVLookupStarted) -> dict[str, object]:
    return {f: getattr(e, f) for f in e.__struct_fields__}
