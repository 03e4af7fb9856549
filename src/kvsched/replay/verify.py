"""Record-and-verify: re-run a logged run in a fresh engine and compare every decision and plan.

The logged inputs (arrivals, aborts, executor outcomes, ...) are fed to a fresh engine built
from the log's config; its decisions are compared, event by event, with the logged ones, and
the digest of each replayed plan with the logged digest. The first difference is a
divergence: step, entity (or plan field), logged value, new value.

Verification is total: whatever a log holds, the result is a ``VerifyResult`` (with or
without a divergence) or a ``LogError`` naming what makes the log unusable (a schema version
this kvsched cannot read, a config it cannot build), never an unexpected exception. Inside
the log, a record that does not decode, an input the engine refuses and a fold that fails are
divergences of their step. Damaged framing is ``events.log.CorruptLogError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
import msgspec
import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.engine import Engine, StepResult
from kvsched.events.codec import (
    RecordDecodeError,
    SchemaVersionError,
    StepRecord,
    check_schema,
    decode_record,
    encode,
    to_builtins,
)
from kvsched.events.log import TornTail, read_log
from kvsched.events.types import CheckpointReserved, Event, entity_of
from kvsched.plan import (
    FIELD_DIGEST_SIZE,
    PLAN_FIELDS,
    StepPlan,
    first_plan_difference,
    plan_digest,
    tail_is_empty,
)
from kvsched.policy import Policy

__all__ = [
    "Divergence",
    "LogError",
    "VerifyResult",
    "first_difference",
    "iter_records",
    "load_config",
    "replay_record",
    "verify_log",
]


class LogError(ValueError):
    """A log this kvsched cannot replay at all (its schema version or its config)."""


@attrs.frozen
class Divergence:
    step: int
    index: int  # position of the decision within the step (-1: not a decision)
    entity: str  # the entity a decision concerns, or "plan", "engine", "record"
    logged: dict[str, object] | None
    new: dict[str, object] | None
    field: str | None = None  # the plan field that differs

    def describe(self) -> str:
        if self.field is not None:
            return (
                f"divergence at step {self.step}: plan field {self.field!r} differs\n"
                f"  logged: {self.logged}\n"
                f"  new:    {self.new}"
            )
        if self.index < 0:
            what = self.logged if self.logged is not None else self.new
            return f"divergence at step {self.step}, {self.entity}: {what}"
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


def first_difference(
    step: int, logged: list[Event], new: list[Event], legacy: bool = False
) -> Divergence | None:
    """The first decision that differs between two decision lists of one step. ``legacy``:
    the log predates schema 3, whose checkpoints do not name their placement rule."""
    for i in range(max(len(logged), len(new))):
        a = logged[i] if i < len(logged) else None
        b = new[i] if i < len(new) else None
        if legacy and isinstance(a, CheckpointReserved) and isinstance(b, CheckpointReserved):
            b = msgspec.structs.replace(b, kind=a.kind)
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


def load_config(header: dict[str, object], path: str) -> SchedulerConfig:
    """The config a log header records, after checking its schema version (LogError)."""
    try:
        version = check_schema(header, f"event log {path}")
    except SchemaVersionError as exc:
        raise LogError(str(exc)) from exc
    raw = header.get("config")
    try:
        return SchedulerConfig.from_log_header(raw, version)  # type: ignore[arg-type]
    except (TypeError, ValueError, AttributeError) as exc:
        why = f"its config is not a valid SchedulerConfig: {exc}"
        raise LogError(f"event log {path}: {why}") from exc


def iter_records(
    path: str,
) -> tuple[dict[str, object], Iterator[tuple[int, bytes]], TornTail | None]:
    """(header, (byte offset, payload) of each complete record, torn tail)."""
    contents = read_log(path)
    return contents.header, zip(contents.offsets, contents.records, strict=True), contents.torn_tail


def _step_divergence(step: int, entity: str, message: str) -> Divergence:
    return Divergence(step, -1, entity, {"error": message}, None)


def verify_log(
    path: str,
    *,
    policy_factory: Callable[[SchedulerConfig], Policy] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> VerifyResult:
    header, records, torn = iter_records(path)
    config = load_config(header, path)
    legacy = is_legacy(header)
    try:
        policy = policy_factory(config) if policy_factory else None
        engine = Engine(config, policy=policy)
    except (TypeError, ValueError, MemoryError) as exc:
        why = f"cannot build an engine from its config: {type(exc).__name__}: {exc}"
        raise LogError(f"event log {path}: {why}") from exc
    steps = 0
    for offset, payload in records:
        _, divergence = replay_record(engine, offset, payload, steps + 1, legacy)
        if divergence is not None:
            return VerifyResult(steps, divergence, torn, config)
        steps += 1
        if on_step is not None:
            on_step(steps)
    return VerifyResult(steps, None, torn, config)


def is_legacy(header: dict[str, object]) -> bool:
    """Whether a (checked) header is of a schema before 3."""
    version = header.get("schema_version")
    return isinstance(version, int) and version < 3


def replay_record(
    engine: Engine, offset: int, payload: bytes, step: int, legacy: bool = False
) -> tuple[tuple[StepRecord, StepResult] | None, Divergence | None]:
    """Replay one logged record (the ``step``-th, at byte ``offset``) through ``engine`` and
    check it: ((record, the replay's result), None), or (None, its divergence). Any failure
    of the replay is the step's divergence."""
    try:
        record = decode_record(payload)
    except RecordDecodeError as exc:
        return None, _step_divergence(step, "record", f"the record at byte {offset} {exc}")
    if record.step != step:
        why = f"the record at byte {offset} is step {record.step}"
        return None, _step_divergence(step, "record", why)
    try:
        result = engine.step(record.inputs, record.clock)
    except Exception as exc:
        return None, _step_divergence(step, "engine", f"{type(exc).__name__}: {exc}")
    divergence = first_difference(step, list(record.decisions), list(result.decisions), legacy)
    if divergence is None and not record.plan:  # every record of schema 2 has a digest
        divergence = _step_divergence(step, "plan", "the record carries no plan digest")
    if divergence is None:
        divergence = _plan_divergence(record, result.plan, engine.config.identity)
    return ((record, result), None) if divergence is None else (None, divergence)


def _plan_divergence(record: StepRecord, plan: StepPlan, scheme: str) -> Divergence | None:
    digest = plan_digest(plan, scheme)
    logged_fields = len(record.plan) // FIELD_DIGEST_SIZE
    field = first_plan_difference(record.plan, digest, tail_is_empty(plan, logged_fields))
    if field is None:
        return None
    if field not in PLAN_FIELDS:  # a plan of another layout
        logged: dict[str, object] = {"digest": record.plan.hex()}
        return Divergence(record.step, -1, "plan", logged, {"digest": digest.hex()}, field)
    i, n = PLAN_FIELDS.index(field), FIELD_DIGEST_SIZE
    value = getattr(plan, field)
    shown = value.tolist()[:16] if isinstance(value, np.ndarray) else value
    logged = {"digest": record.plan[i * n : (i + 1) * n].hex()}
    new: dict[str, object] = {"digest": digest[i * n : (i + 1) * n].hex(), "value": shown}
    return Divergence(record.step, -1, "plan", logged, new, field)
