"""replay/driver.py: ``run``, the loop that feeds a workload and each step's outcome to an
engine on a simulated clock."""

from __future__ import annotations

from tests.policy.helpers import config

from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.replay.driver import run
from kvsched.replay.workload import chat_workload


def small():
    cfg = config(num_blocks=256, max_batch=8, model=config().model)
    w = chat_workload(
        sessions=3,
        turns=2,
        system_tokens=40,
        user_tokens=(8, 24),
        output_tokens=(2, 6),
        vocab_size=cfg.model.vocab_size,
        seed=2,
    )
    return cfg, w


def test_every_turn_of_the_workload_arrives_and_finishes():
    cfg, w = small()
    summary = run(Engine(cfg), SimulatedExecutor(cfg.model.vocab_size), w)
    assert summary.requests == summary.finished == len(w.turns)
    assert summary.generated_tokens == sum(t.request.max_tokens for t in w.turns)


def test_one_workload_runs_to_the_same_summary_twice():
    cfg, w = small()
    a = run(Engine(cfg), SimulatedExecutor(cfg.model.vocab_size), w).as_dict()
    b = run(Engine(cfg), SimulatedExecutor(cfg.model.vocab_size), w).as_dict()
    a.pop("wall_time_s"), b.pop("wall_time_s")
    assert a == b


class Failing(SimulatedExecutor):
    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.failed = False

    def execute(self, plan):  # type: ignore[no-untyped-def]
        if not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return super().execute(plan)


def test_an_executor_that_raises_becomes_a_step_failed_input_of_the_next_step():
    cfg, w = small()
    seen: list[ev.Event] = []
    engine = Engine(cfg)
    run(engine, Failing(cfg.model.vocab_size), w, on_step=lambda r: seen.extend(r.inputs))
    assert any(isinstance(e, ev.StepFailed) for e in seen)
