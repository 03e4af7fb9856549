"""Record-and-verify: re-run a logged run in a fresh engine and compare every decision.

The logged inputs (arrivals, aborts, executor outcomes, ...) are fed to a fresh engine built
from the log's config; its decisions are compared, event by event, with the logged ones. The
first difference is a divergence: step, entity, logged decision, new decision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs

from kvsched.config import SchedulerConfig
from kvsched.engine import Engine
from kvsched.events.codec import StepRecord, decode_record, encode, to_builtins
from kvsched.events.log import TornTail, read_log
from kvsched.events.types import Event, entity_of
from kvsched.policy import Policy
from kvsched.reducers.state import ReplayMismatch


@attrs.frozen
class Divergence:
    step: int
    index: int  # position of the decision within the step
    entity: str
    logged: dict[str, object] | None
    new: dict[str, object] | None

    def describe(self) -> str:
        return (
            f"divergence at step {self.step}, decision #{self.index}, {self.entity}:\n"
            f"  logged: {self.logged}\n"
            f"  new:    {self.new}"
        )


@attrs.frozen
class VerifyResult:
    steps: int
    divergence: Divergence | None
    torn_tail: TornTail | None
    config: SchedulerConfig

    @property
    def ok(self) -> bool:
        return self.divergence is None


def first_difference(step: int, logged: list[Event], new: list[Event]) -> Divergence | None:
    """The first decision that differs between two decision lists of one step."""
    for i in range(max(len(logged), len(new))):
        a = logged[i] if i < len(logged) else None
        b = new[i] if i < len(new) else None
        if a is not None and b is not None and encode(a) == encode(b):
            continue
        entity = entity_of(a if a is not None else b)  # type: ignore[arg-type]
        return Divergence(
            step,
            i,
            entity,
            to_builtins(a) if a is not None else None,
            to_builtins(b) if b is not None else None,
        )
    return None


def iter_records(path: str) -> tuple[dict[str, object], Iterator[StepRecord], TornTail | None]:
    contents = read_log(path)
    return contents.header, map(decode_record, contents.records), contents.torn_tail


def verify_log(
    path: str,
    *,
    policy_factory: Callable[[SchedulerConfig], Policy] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> VerifyResult:
    header, records, torn = iter_records(path)
    config = SchedulerConfig.from_dict(header["config"])  # type: ignore[arg-type]
    policy = policy_factory(config) if policy_factory else None
    engine = Engine(config, policy=policy)
    steps = 0
    for record in records:
        try:
            new = list(engine.step(record.inputs, record.clock).decisions)
        except ReplayMismatch as exc:
            failed = Divergence(record.step, -1, "engine", {"error": str(exc)}, None)
            return VerifyResult(steps, failed, torn, config)
        div = first_difference(record.step, list(record.decisions), new)
        if div is not None:
            return VerifyResult(steps, div, torn, config)
        steps += 1
        if on_step is not None:
            on_step(steps)
    return VerifyResult(steps, None, torn, config)
