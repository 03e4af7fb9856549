"""Record-and-verify: re-run a logged run in a fresh engine and compare every decision and plan.

The logged inputs (arrivals, aborts, executor outcomes, ...) are fed to a fresh engine built
from the log's config; its decisions are compared, event by event, with the logged ones, and
the digest of each replayed plan with the logged digest. The first difference is a
divergence: step, entity (or plan field), logged value, new value.

Verification is total: whatever a log holds, the result is a ``VerifyResult`` (with or
without a divergence) or a ``LogError`` naming what makes the log unusable (a schema version
this kvsched cannot read, a config it cannot build), never an unexpected exception. The log is
read one record at a time (memory does not grow with its size).

Three reports for three kinds of trouble:

* a divergence: re-executing a step decides or plans differently from the log (a decision, a
  plan field, or the engine refusing the logged inputs);
* damage: ``events.log.CorruptLogError`` naming the byte offset, with ``steps`` verified before
  it: damaged framing, or a record that does not decode, carries no plan digest, or holds
  another step than the next one;
* a crash's leftovers, reported beside a verified result: a torn tail (``torn_tail``) or zero
  bytes after the last complete step (``padding``).

Ctrl-C raises ``VerifyInterrupted`` (a ``KeyboardInterrupt``) carrying the steps verified.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import msgspec
import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.engine import Engine, LookupAnswer, LookupPort, StepResult
from kvsched.events.codec import (
    RecordDecodeError,
    SchemaVersionError,
    StepRecord,
    check_schema,
    decode_record,
    encode,
    to_builtins,
)
from kvsched.events.log import CorruptLogError, LogReader, TornTail
from kvsched.events.types import CheckpointReserved, Event, KVLookupStarted, entity_of
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
    "RecordDamage",
    "VerifyInterrupted",
    "VerifyResult",
    "first_difference",
    "load_config",
    "replay_record",
    "verify_log",
]


class LogError(ValueError):
    """A log this kvsched cannot replay at all (its schema version or its config)."""


class VerifyInterrupted(KeyboardInterrupt):
    """Ctrl-C during a verification, after ``steps`` verified steps (and no divergence)."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.steps = steps

    def __str__(self) -> str:
        n = self.steps
        return f"interrupted after {n} steps; {n} steps verified, 0 divergences so far"


@attrs.frozen
class RecordDamage:
    """A record that is not the next step record of its log (damage, not a divergence)."""

    step: int  # the step the record should hold
    offset: int  # its frame's byte offset
    reason: str  # what is wrong with it: "is not a step record ...", "holds step 7 ..."

    def describe(self) -> str:
        return f"the record at byte {self.offset} {self.reason}"


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
            shown = what["error"] if what is not None and set(what) == {"error"} else what
            return f"divergence at step {self.step}, {self.entity}: {shown}"
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
    padding: int = 0  # zero bytes after the last complete step (crash padding)

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


def _step_divergence(step: int, entity: str, message: str) -> Divergence:
    return Divergence(step, -1, entity, {"error": message}, None)


def verify_log(
    path: str,
    *,
    policy_factory: Callable[[SchedulerConfig], Policy] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> VerifyResult:
    """Verify the log at ``path`` step by step (see the module docstring). Raises
    ``CorruptLogError`` (with ``steps``), ``LogError``, ``OSError`` or ``VerifyInterrupted``."""
    steps = 0
    try:
        reader = LogReader(path)
        config = load_config(reader.header, path)
        engine = _engine(path, config, policy_factory)
        legacy = is_legacy(reader.header)
        for offset, payload in reader:
            _, problem = replay_record(engine, offset, payload, steps + 1, legacy)
            if isinstance(problem, RecordDamage):
                raise CorruptLogError(path, offset, f"the record {problem.reason}")
            if problem is not None:
                return VerifyResult(steps, problem, None, config)
            steps += 1
            if on_step is not None:
                on_step(steps)
    except CorruptLogError as exc:
        exc.steps = steps
        raise
    except KeyboardInterrupt:
        raise VerifyInterrupted(steps) from None
    return VerifyResult(steps, None, reader.torn_tail, config, reader.padding)


def _engine(
    path: str, config: SchedulerConfig, policy_factory: Callable[[SchedulerConfig], Policy] | None
) -> Engine:
    try:
        policy = policy_factory(config) if policy_factory else None
        return Engine(config, policy=policy)
    except (TypeError, ValueError, MemoryError) as exc:
        why = f"cannot build an engine from its config: {type(exc).__name__}: {exc}"
        raise LogError(f"event log {path}: {why}") from exc


def is_legacy(header: dict[str, object]) -> bool:
    """Whether a (checked) header is of a schema before 3."""
    version = header.get("schema_version")
    return isinstance(version, int) and version < 3


def replay_record(
    engine: Engine, offset: int, payload: bytes, step: int, legacy: bool = False
) -> tuple[tuple[StepRecord, StepResult] | None, Divergence | RecordDamage | None]:
    """Replay one logged record (the ``step``-th, at byte ``offset``) through ``engine`` and
    check it: ((record, the replay's result), None), or (None, what is wrong): a
    ``RecordDamage`` if the record is not the step's record (it does not decode, holds
    another step or carries no plan digest: the engine is not run), else the divergence of
    the replay (a decision, the plan, or the engine refusing the logged inputs)."""
    try:
        record = decode_record(payload)
    except RecordDecodeError as exc:
        return None, RecordDamage(step, offset, f"of step {step} is {exc}")
    if record.step != step:
        why = f"holds step {record.step} where step {step} was expected"
        return None, RecordDamage(step, offset, why)
    if not record.plan:  # every record of schema 2 on has a digest
        return None, RecordDamage(step, offset, f"of step {step} carries no plan digest")
    try:
        result = engine.step(record.inputs, record.clock, recorded_answers(record))
    except Exception as exc:
        why = f"the engine refused the logged inputs: {type(exc).__name__}: {exc}"
        return None, _step_divergence(step, "engine", why)
    divergence = first_difference(step, list(record.decisions), list(result.decisions), legacy)
    if divergence is None:
        divergence = _plan_divergence(record, result.plan, engine.config.identity)
    return ((record, result), None) if divergence is None else (None, divergence)


def recorded_answers(record: StepRecord) -> LookupPort | None:
    """The lookup port that gives a replay the answers the step's lookups got within it
    (``KVLookupStarted.answer``); None when it had none."""
    started: list[KVLookupStarted] = [
        d for d in record.decisions if isinstance(d, KVLookupStarted)
    ]
    answers = {d.seq_id: LookupAnswer(d.answer, d.sync_load) for d in started if d.answer >= 0}
    return (lambda e: answers.get(e.seq_id)) if answers else None


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
