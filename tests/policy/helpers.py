"""Helpers for scheduler behaviour tests: a small engine driven step by step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvsched.config import CHECKPOINT_POLICIES, ModelSpec, SchedulerConfig
from kvsched.engine import Engine, StepResult
from kvsched.events import types as ev
from kvsched.events.codec import SCHEMA_VERSION
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.headers import FLAT_NAMES, FLAT_OF
from kvsched.reducers.state import EngineState

VOCAB = 1000


def config(**overrides: object) -> SchedulerConfig:
    """A small config: 16-token blocks, 64 blocks, 8 rows, 64-token prefill budget. Flat
    names of sub-config fields are read (FLAT_NAMES); a behaviour of kvsched before schema 4
    (a Legacy field) makes it an old log's config (``from_log_header``), as only those run it."""
    base: dict[str, object] = {
        "model": ModelSpec(vocab_size=VOCAB, max_context=1024),
        "block_size": 16,
        "num_blocks": 64,
        "max_batch": 8,
        "max_prefill_tokens": 64,
    }
    base.update(overrides)
    if any(FLAT_NAMES.get(k, ("",))[0] == "legacy" for k in overrides):
        return SchedulerConfig.from_log_header(base, SCHEMA_VERSION)
    return SchedulerConfig.from_dict(base)  # (flat names of sub-config fields: FLAT_NAMES)


def preset(name: str) -> dict[str, object]:
    """A named checkpoint policy as ``config``'s flat keyword arguments."""
    return {FLAT_OF["checkpoints", k]: v for k, v in CHECKPOINT_POLICIES[name].items()}


def tokens(n: int, seed: int) -> np.ndarray:
    """``n`` deterministic token ids (never 0, which no test uses as EOS)."""
    return np.random.default_rng(seed).integers(1, VOCAB, n, dtype=np.int32)


def request(seq_id: int, prompt: int | np.ndarray, max_tokens: int = 4, **kw: object):
    if isinstance(prompt, int):
        prompt = tokens(prompt, seed=1000 + seq_id)
    return ev.RequestArrived(seq_id=seq_id, prompt=prompt, max_tokens=max_tokens, **kw)


class Harness:
    """An engine plus a simulated executor; each ``step`` feeds the previous outcome."""

    def __init__(self, cfg: SchedulerConfig | None = None, **overrides: object) -> None:
        self.config = cfg if cfg is not None else config(**overrides)
        self.engine = Engine(self.config, check_invariants=True)
        self.executor = SimulatedExecutor(self.config.model.vocab_size)
        self.outcome: list[ev.Event] = []
        self.clock = 0.0
        self.results: list[StepResult] = []

    @property
    def state(self) -> EngineState:
        return self.engine.state

    def step(self, inputs: Iterable[ev.Event] = (), clock: float | None = None) -> StepResult:
        if clock is not None:
            self.clock = clock
        result = self.engine.step([*self.outcome, *inputs], self.clock)
        self.results.append(result)
        self.outcome = []
        if not result.plan.is_empty:
            self.outcome.append(self.executor.execute(result.plan))
        self.clock += 0.001
        return result

    def run_until_idle(self, max_steps: int = 500) -> list[StepResult]:
        out = []
        for _ in range(max_steps):
            if not self.engine.has_work and not self.outcome:
                return out
            out.append(self.step())
        raise AssertionError("the engine did not become idle")


def of_type(decisions: Sequence[ev.Event], kind: type) -> list:
    return [d for d in decisions if isinstance(d, kind)]


def prefills(result: StepResult) -> list[tuple[int, int, int]]:
    """(seq_id, start, end) of every prefill chunk scheduled in the step."""
    out = []
    for d in of_type(result.decisions, ev.PrefillScheduled):
        out.extend(zip(d.seq_ids.tolist(), d.starts.tolist(), d.ends.tolist(), strict=True))
    return out


def admitted(result: StepResult) -> list[int]:
    return [d.seq_id for d in of_type(result.decisions, ev.SequenceAdmitted)]


def matched(result: StepResult) -> dict[int, ev.PrefixMatched]:
    return {d.seq_id: d for d in of_type(result.decisions, ev.PrefixMatched)}


def state_snapshot(state: EngineState) -> tuple[object, ...]:
    """Everything the engine state owns, as plain comparable data."""
    return state.snapshot()
