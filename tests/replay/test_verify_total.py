"""``kvsched verify`` is total: whatever a log holds, ``verify_log`` returns a ``VerifyResult``
(verified, or with the first divergence) or raises one of the documented log errors
(``CorruptLogError`` for a damaged log: its framing, or a record that is not the next step
record; ``LogError`` for a schema version or config this kvsched cannot replay), and
``kvsched verify`` exits 0 / 1 / 2 without a traceback.

Recorded runs (random configs and workloads, simulated executor, injected executor failures)
get one random edit of their records; the divergence (or the damage) must be reported where
the edit is (or, for an edited input, where a fresh engine fed the edited inputs first
disagrees with the log).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import msgspec
import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from tests.replay.log_helpers import write_log

import kvsched.cli
import kvsched.engine
from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine, create_log
from kvsched.events import types as ev
from kvsched.events.codec import (
    SCHEMA_VERSION,
    RecordDecodeError,
    StepRecord,
    decode_record,
    encode,
)
from kvsched.events.log import (
    MAGIC,
    PREFIX_SIZE,
    CorruptLogError,
    EventLog,
    encode_frame,
    read_log,
)
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.plan import FIELD_DIGEST_SIZE, PLAN_FIELDS, StepPlan, plan_digest
from kvsched.replay.verify import LogError, VerifyResult, verify_log

VOCAB = 64
Schedule = Mapping[int, Sequence[ev.Event]]


# ------------------------------------------------------------------------ recording


def record(
    path: str,
    config: SchedulerConfig,
    schedule: Schedule,
    fail_steps: frozenset[int] = frozenset(),
    max_steps: int = 400,
) -> list[StepPlan]:
    """Run ``schedule`` (engine step -> inputs) with the simulated executor, recording to
    ``path``; the executor "raises" (``StepFailed``) at the steps in ``fail_steps``.
    Returns each step's plan."""
    engine = Engine(config, log=create_log(path, config))
    executor = SimulatedExecutor(config.model.vocab_size)
    last_input = max(schedule, default=0)
    outcome: list[ev.Event] = []
    plans: list[StepPlan] = []
    clock = 0.0
    try:
        for n in range(1, max_steps + 1):
            if n > last_input and not outcome and not engine.has_work:
                break
            inputs = [
                msgspec.structs.replace(e, arrival_time=clock)
                if isinstance(e, ev.RequestArrived)
                else e
                for e in schedule.get(n, ())
            ]
            result = engine.step([*outcome, *inputs], clock)
            plans.append(result.plan)
            outcome = []
            if not result.plan.is_empty:
                if n in fail_steps:
                    outcome = [ev.StepFailed(result.plan.step, "injected fault")]
                    clock += 0.001
                else:
                    executed = executor.execute(result.plan)
                    outcome = [executed]
                    clock += executed.duration_s
    finally:
        assert engine.log is not None
        engine.log.close()
    return plans


def payloads_of(path: str) -> list[bytes]:
    return read_log(path).records


def arrive(seq_id: int, prompt: Sequence[int], max_tokens: int, **kw: Any) -> ev.RequestArrived:
    return ev.RequestArrived(seq_id, np.asarray(prompt, np.int32), max_tokens, **kw)


@st.composite
def recorded_runs(
    draw: st.DrawFn,
) -> tuple[SchedulerConfig, dict[int, list[ev.Event]], frozenset[int]]:
    bs = draw(st.sampled_from([4, 8]))
    hybrid = draw(st.booleans())
    config = SchedulerConfig.from_dict(
        dict(
            model=ModelSpec(vocab_size=VOCAB, max_context=128),
            block_size=bs,
            num_blocks=draw(st.integers(8, 24)),
            max_batch=draw(st.integers(1, 4)),
            max_prefill_tokens=bs * draw(st.integers(1, 3)),
            enable_prefix_caching=draw(st.booleans()),
            hybrid=hybrid,
            checkpoint_budget=draw(st.integers(1, 4)) if hybrid else 256,
        )
    )
    token = st.integers(0, VOCAB - 1)
    prefixes = draw(st.lists(st.lists(token, min_size=bs, max_size=3 * bs), min_size=1, max_size=2))
    schedule: dict[int, list[ev.Event]] = {}
    n_requests = draw(st.integers(1, 5))
    for seq_id in range(n_requests):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(token, min_size=1, max_size=bs))
        request = arrive(
            seq_id,
            prompt,
            draw(st.integers(1, 12)),
            priority=draw(st.integers(0, 2)),
            session_id=draw(st.sampled_from([-1, -1, 0, 1])),
            eos_token_id=draw(st.sampled_from([-1, -1, 7])),
        )
        schedule.setdefault(draw(st.integers(1, 8)), []).append(request)
    for _ in range(draw(st.integers(0, 2))):
        schedule.setdefault(draw(st.integers(1, 14)), []).append(
            ev.RequestAborted(draw(st.integers(0, n_requests)))  # may be unknown or finished
        )
    if draw(st.booleans()):
        schedule.setdefault(draw(st.integers(1, 14)), []).append(ev.SessionEnded(0))
    if draw(st.booleans()):
        at = draw(st.integers(1, 10))
        schedule.setdefault(at, []).append(ev.DrainRequested())
        schedule.setdefault(at + draw(st.integers(1, 4)), []).append(ev.WakeRequested())
    fail_steps = frozenset(draw(st.lists(st.integers(1, 25), max_size=2)))
    return config, schedule, fail_steps


# ------------------------------------------------------------------------ mutations


@attrs.frozen
class Mutation:
    """One edit of a log's records, and where ``verify_log`` must report it."""

    what: str
    payloads: list[bytes]
    # "at": a divergence at ``step`` (``index``: the decision, ``entity``, ``plan``: a plan
    # field); "corrupt": a CorruptLogError at the record ``offset`` (its position in
    # ``payloads``), ``step`` - 1 steps verified before it;
    # "ok": verified, ``step`` steps; "replay": wherever a fresh engine fed the edited records
    # first disagrees with them (nothing observable changed: verified).
    expect: str
    step: int = 0
    index: int | None = None
    entity: str | None = None
    plan: bool = False
    offset: int | None = None


def first_event_difference(a: Sequence[ev.Event], b: Sequence[ev.Event]) -> int | None:
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or encode(a[i]) != encode(b[i]):
            return i
    return None


HUGE = 2**40
INT_EDITS: tuple[Callable[[int], int], ...] = (
    lambda v: v + 1,
    lambda v: v - 1,
    lambda v: 0,
    lambda v: HUGE,
    lambda v: -HUGE,
    lambda v: 2**63,  # beyond int64 (still a msgpack uint64)
)
FLOAT_EDITS: tuple[Callable[[float], float], ...] = (
    lambda v: v + 1.0,
    lambda v: v - 1.0,
    lambda v: 0.0,
    lambda v: float(HUGE),
    lambda v: math.nan,
    lambda v: math.inf,
)


def edited_array(draw: st.DrawFn, arr: np.ndarray) -> np.ndarray:
    if len(arr) == 0 or draw(st.booleans()):
        return arr[: draw(st.integers(0, max(0, len(arr) - 1)))].copy()  # truncated
    out = arr.copy()
    j = draw(st.integers(0, len(arr) - 1))
    if arr.dtype.kind == "b":
        out[j] = not out[j]
    elif arr.dtype.kind in "iu":
        info = np.iinfo(arr.dtype)
        value = draw(st.sampled_from([int(arr[j]) + 1, int(arr[j]) - 1, 0, info.max, info.min]))
        out[j] = min(max(value, int(info.min)), int(info.max))
    else:
        out[j] = out[j] + 1
    return out


def edited_value(draw: st.DrawFn, value: Any) -> Any:
    """Another value of the same kind (it may happen to equal the old one)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return draw(st.sampled_from(INT_EDITS))(value)
    if isinstance(value, float):
        return draw(st.sampled_from(FLOAT_EDITS))(value)
    if isinstance(value, str):
        return draw(st.sampled_from(["", value + "x", "stop", "length", "abort"]))
    if isinstance(value, bytes):
        if not value or draw(st.booleans()):
            return value[: len(value) // 2] + b"\x01"
        j = draw(st.integers(0, len(value) - 1))
        return value[:j] + bytes([value[j] ^ 0xFF]) + value[j + 1 :]
    if isinstance(value, np.ndarray):
        return edited_array(draw, value)
    if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
        j = draw(st.integers(0, len(value) - 1))
        return (*value[:j], edited_value(draw, value[j]), *value[j + 1 :])
    if isinstance(value, tuple):
        return value[:-1]
    raise AssertionError(f"no edit for {type(value).__name__}")


OTHER_KIND: dict[type[ev.Event], type[ev.Event]] = {
    ev.DrainRequested: ev.WakeRequested,
    ev.WakeRequested: ev.DrainRequested,
    ev.CacheCleared: ev.Woken,
    ev.Woken: ev.Drained,
    ev.Drained: ev.DrainDeferred,
}


def edit_event(draw: st.DrawFn, e: ev.Event) -> tuple[ev.Event, str]:
    fields = e.__struct_fields__
    if not fields:  # e.g. Woken, DrainRequested: nothing to change but its kind
        return OTHER_KIND.get(type(e), ev.CacheCleared)(), "kind"
    name = draw(st.sampled_from(fields))
    return msgspec.structs.replace(e, **{name: edited_value(draw, getattr(e, name))}), name


def with_record(payloads: list[bytes], k: int, new: StepRecord) -> list[bytes]:
    return [*payloads[:k], encode(new), *payloads[k + 1 :]]


MUTATIONS = (
    "drop input",
    "edit input",
    "drop decision",
    "edit decision",
    "swap decisions",
    "drop record",
    "duplicate record",
    "edit clock",
    "edit step",
    "replace plan digest",
    "garbage payload",
    "flip payload byte",
)


@st.composite
def mutations(draw: st.DrawFn, payloads: list[bytes]) -> Mutation:
    records = [decode_record(p) for p in payloads]
    n = len(records)
    kind = draw(st.sampled_from(MUTATIONS))
    with_inputs = [k for k, r in enumerate(records) if r.inputs]
    if kind in ("drop input", "edit input") and not with_inputs:
        kind = "edit decision"
    with_pairs = [k for k, r in enumerate(records) if len(r.decisions) >= 2]
    if kind == "swap decisions" and not with_pairs:
        kind = "drop decision"
    pool = with_inputs if kind in ("drop input", "edit input") else range(n)
    if kind == "swap decisions":
        pool = with_pairs
    k = draw(st.sampled_from(list(pool)))
    rec, step = records[k], k + 1
    what = f"{kind} (record {step} of {n})"

    if kind in ("drop input", "edit input"):
        i = draw(st.integers(0, len(rec.inputs) - 1))
        inputs = list(rec.inputs)
        if kind == "drop input":
            del inputs[i]
            what += f": {type(rec.inputs[i]).__name__} #{i}"
        else:
            inputs[i], name = edit_event(draw, inputs[i])
            what += f": {type(rec.inputs[i]).__name__} #{i} .{name} -> {inputs[i]}"
        return Mutation(what, with_record(payloads, k, attrs_replace(rec, inputs=inputs)), "replay")

    if kind in ("drop decision", "edit decision", "swap decisions"):
        decisions = list(rec.decisions)
        i = draw(st.integers(0, len(decisions) - (2 if kind == "swap decisions" else 1)))
        if kind == "drop decision":
            del decisions[i]
        elif kind == "edit decision":
            decisions[i], name = edit_event(draw, decisions[i])
            what += f": .{name}"
        else:
            decisions[i], decisions[i + 1] = decisions[i + 1], decisions[i]
        what += f" #{i} ({type(rec.decisions[i]).__name__})"
        edited = with_record(payloads, k, attrs_replace(rec, decisions=decisions))
        index = first_event_difference(rec.decisions, decisions)
        if index is None:  # e.g. two equal decisions swapped: the record is the same
            return Mutation(what + " [no change]", edited, "ok", n)
        return Mutation(what, edited, "at", step, index=index)

    if kind == "drop record":
        edited = payloads[:k] + payloads[k + 1 :]
        if k == n - 1:  # a log cut at a record boundary: a shorter run
            return Mutation(what, edited, "ok", n - 1)
        return Mutation(what, edited, "corrupt", step, offset=k)

    if kind == "duplicate record":
        edited = payloads[: k + 1] + payloads[k:]
        return Mutation(what, edited, "corrupt", step + 1, offset=k + 1)

    if kind == "edit clock":
        clock = draw(st.sampled_from(FLOAT_EDITS))(rec.clock)
        what += f": {rec.clock} -> {clock}"
        edited = with_record(payloads, k, attrs_replace(rec, clock=clock))
        if clock == rec.clock:
            return Mutation(what + " [no change]", edited, "ok", n)
        return Mutation(what, edited, "at", step)

    if kind == "edit step":
        new_step = draw(st.sampled_from(INT_EDITS))(rec.step)
        what += f": {rec.step} -> {new_step}"
        edited = with_record(payloads, k, attrs_replace(rec, step=new_step))
        if new_step == rec.step:
            return Mutation(what + " [no change]", edited, "ok", n)
        return Mutation(what, edited, "corrupt", step, offset=k)

    if kind == "replace plan digest":
        size = len(rec.plan)
        digest = draw(
            st.one_of(
                st.binary(min_size=size, max_size=size),  # same layout, other bytes
                st.binary(min_size=1, max_size=2 * size),  # another layout
                st.sampled_from([r.plan for r in records]),  # another step's digest
            )
        )
        edited = with_record(payloads, k, attrs_replace(rec, plan=digest))
        if digest == rec.plan:
            return Mutation(what + " [no change]", edited, "ok", n)
        return Mutation(what, edited, "at", step, plan=True)

    if kind == "garbage payload":
        garbage = draw(st.binary(max_size=64))
        assume(decodes(garbage) is False)
        edited = [*payloads[:k], garbage, *payloads[k + 1 :]]
        return Mutation(what, edited, "corrupt", step, offset=k)

    assert kind == "flip payload byte"
    payload = bytearray(payloads[k])
    j = draw(st.integers(0, len(payload) - 1))
    payload[j] ^= draw(st.integers(1, 255))
    edited = [*payloads[:k], bytes(payload), *payloads[k + 1 :]]
    what += f" at {j}"
    if not decodes(bytes(payload)):
        return Mutation(what, edited, "corrupt", step, offset=k)
    return Mutation(what + " [decodes]", edited, "replay")


def attrs_replace(rec: StepRecord, **changes: Any) -> StepRecord:
    return msgspec.structs.replace(rec, **changes)


def decodes(payload: bytes) -> bool:
    """Whether the payload is a step record of this schema."""
    try:
        decode_record(payload)
    except RecordDecodeError:
        return False
    return True


def first_replay_difference(config: SchedulerConfig, payloads: Sequence[bytes]) -> int | None:
    """The first step at which a record is damaged (see ``first_damage``), or a fresh engine
    fed these records' inputs and clocks refuses them, or decides or plans differently from
    them (None: it reproduces all of them)."""
    engine = Engine(config)
    for n, payload in enumerate(payloads, 1):
        if first_damage(payloads[n - 1 : n], n) is not None:
            return n
        rec = decode_record(payload)
        try:
            result = engine.step(rec.inputs, rec.clock)
        except Exception:
            return n
        if first_event_difference(rec.decisions, result.decisions) is not None:
            return n
        if rec.plan != plan_digest(result.plan, engine.config.identity):
            return n
    return None


def first_damage(payloads: Sequence[bytes], first: int = 1) -> int | None:
    """The first step (counting from ``first``) whose record does not decode, holds another
    step or carries no plan digest."""
    for n, payload in enumerate(payloads, first):
        try:
            rec = decode_record(payload)
        except RecordDecodeError:
            return n
        if rec.step != n or not rec.plan:
            return n
    return None


def expected_plan_field(logged: bytes, replayed: bytes) -> str:
    n = FIELD_DIGEST_SIZE
    for i, name in enumerate(PLAN_FIELDS):
        if logged[i * n : (i + 1) * n] != replayed[i * n : (i + 1) * n]:
            return name
    return "<plan layout>"


def verify_totally(path: str) -> VerifyResult | CorruptLogError | LogError:
    """``verify_log``'s result or documented error; any other exception fails the test."""
    try:
        return verify_log(path)
    except (CorruptLogError, LogError) as exc:
        return exc


def check_mutation(
    config: SchedulerConfig, src: str, dst: str, mutation: Mutation
) -> VerifyResult | CorruptLogError:
    offsets = write_log(src, dst, mutation.payloads)
    got = verify_totally(dst)
    what = mutation.what
    damaged = first_damage(mutation.payloads)
    if mutation.expect == "corrupt" or (mutation.expect == "replay" and damaged is not None):
        # Only the records changed: a damaged one is named by its byte offset, never a
        # divergence, and every step before it was verified.
        assert isinstance(got, CorruptLogError), f"{what}: {got}"
        step = mutation.step if mutation.expect == "corrupt" else damaged
        assert step == damaged, f"{what}: {got}"
        k = mutation.offset if mutation.offset is not None else step - 1
        assert got.offset == offsets[k], f"{what}: {got}"
        assert got.steps == step - 1, f"{what}: {got}"
        assert "the record " in got.reason
        return got
    # Only the records changed: the header and the framing are intact.
    assert isinstance(got, VerifyResult), f"{what}: {type(got).__name__}: {got}"
    div = got.divergence
    shown = div.describe() if div is not None else "verified"
    assert got.torn_tail is None
    assert got.config == config

    if mutation.expect == "ok":
        assert div is None, f"{what}: {shown}"
        assert got.steps == mutation.step
        return got
    if mutation.expect == "replay":
        at = first_replay_difference(config, mutation.payloads)
        if at is None:  # the edit changed nothing observable: the edited log is a valid run
            event("edited input without effect")
            assert div is None, f"{what}: {shown}"
            assert got.steps == len(mutation.payloads)
        else:
            assert div is not None, f"{what}: verified, but a replay differs at step {at}"
            assert div.step == at, f"{what}: {shown}"
            assert got.steps == at - 1
        return got

    assert div is not None, f"{what}: verified"
    assert div.step == mutation.step, f"{what}: {shown}"
    assert got.steps == mutation.step - 1, f"{what}: {shown}"
    assert shown.startswith(f"divergence at step {mutation.step}")
    if mutation.index is not None:
        assert div.index == mutation.index, f"{what}: {shown}"
    if mutation.entity is not None:
        assert div.entity == mutation.entity, f"{what}: {shown}"
    if mutation.plan:
        rec = decode_record(mutation.payloads[mutation.step - 1])
        replayed = decode_record(payloads_of(src)[mutation.step - 1]).plan
        assert div.entity == "plan" and div.field == expected_plan_field(rec.plan, replayed)
        assert repr(div.field) in shown
    # The reference replay agrees (a cross-check of the expectation itself).
    assert first_replay_difference(config, mutation.payloads) == mutation.step, what
    return got


# ---------------------------------------------------------------- (1) the property


# At least 200 examples (about 5-8 s: a recorded run, its verification and a reference replay
# each); HYPOTHESIS_PROFILE=deep runs the profile's many more.
@settings(max_examples=max(200, settings.default.max_examples), deadline=None)
@given(run=recorded_runs(), data=st.data())
def test_any_single_edit_of_a_recorded_log_is_reported_where_it_is_and_nothing_raises(
    run: tuple[SchedulerConfig, dict[int, list[ev.Event]], frozenset[int]], data: st.DataObject
):
    config, schedule, fail_steps = run
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "run.kvlog"), os.path.join(tmp, "edited.kvlog")
        plans = record(src, config, schedule, fail_steps)
        payloads = payloads_of(src)
        assert verify_log(src).ok  # the unedited run verifies
        event(f"steps: {'<10' if len(plans) < 10 else '<30' if len(plans) < 30 else '30+'}")
        event(f"hybrid: {config.hybrid}")
        event(f"failed step: {any(p.step in fail_steps for p in plans if not p.is_empty)}")
        mutation = data.draw(mutations(payloads), label="mutation")
        event(mutation.what.split(" (")[0])
        check_mutation(config, src, dst, mutation)


@settings(max_examples=max(20, settings.default.max_examples // 2), deadline=None)
@given(run=recorded_runs(), cut=st.floats(0, 1), flip=st.integers(1, 255))
def test_damaged_framing_is_a_corrupt_log_error_and_a_cut_log_verifies_its_complete_steps(
    run: tuple[SchedulerConfig, dict[int, list[ev.Event]], frozenset[int]], cut: float, flip: int
):
    config, schedule, fail_steps = run
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.kvlog")
        record(path, config, schedule, fail_steps)
        contents = read_log(path)
        data = Path(path).read_bytes()
        first = contents.offsets[0]
        at = first + int(cut * (len(data) - first - 1))

        damaged = bytearray(data)
        damaged[at] ^= flip
        Path(path).write_bytes(bytes(damaged))
        got = verify_totally(path)
        assert isinstance(got, CorruptLogError), got
        assert got.offset == max(o for o in contents.offsets if o <= at)

        Path(path).write_bytes(data[:at])
        got = verify_totally(path)
        assert isinstance(got, VerifyResult) and got.ok, got
        assert got.steps == sum(
            o + PREFIX_SIZE + len(r) <= at
            for o, r in zip(contents.offsets, contents.records, strict=True)
        )
        assert (got.torn_tail is None) == (at in contents.offsets)


# ------------------------------------------------------------------- fixed runs

CONFIG = SchedulerConfig(
    model=ModelSpec(vocab_size=VOCAB, max_context=256),
    block_size=4,
    num_blocks=24,
    max_batch=4,
    max_prefill_tokens=8,
)
SHARED = list(range(1, 10))
SCHEDULE: dict[int, list[ev.Event]] = {
    1: [arrive(0, [*SHARED, 11, 12], 6), arrive(1, [*SHARED, 13], 4)],
    3: [arrive(2, [*SHARED, 14, 15, 16], 5, session_id=0)],
    5: [ev.RequestAborted(1), ev.RequestAborted(99)],
    7: [ev.DrainRequested()],
    8: [ev.WakeRequested(), arrive(3, [*SHARED, 17], 3)],
    10: [ev.SessionEnded(0)],
}


@pytest.fixture
def fixed_run(tmp_path: Path) -> tuple[str, list[bytes], list[StepPlan]]:
    path = str(tmp_path / "run.kvlog")
    plans = record(path, CONFIG, SCHEDULE, frozenset({4}))
    return path, payloads_of(path), plans


def edit(payloads: list[bytes], at: int, **changes: Any) -> list[bytes]:
    """The payloads with record ``at`` (1-based) changed."""
    rec = decode_record(payloads[at - 1])
    return with_record(payloads, at - 1, attrs_replace(rec, **changes))


# --------------------------------------------------------------------- (2) the CLI


def cli_mutations(payloads: list[bytes]) -> dict[str, tuple[list[bytes], int | None]]:
    """Edited payloads, and the step whose divergence they are (None: some later step)."""
    recs = [decode_record(p) for p in payloads]
    arrival = next(
        k for k, r in enumerate(recs) if any(isinstance(e, ev.RequestArrived) for e in r.inputs)
    )
    inputs = list(recs[arrival].inputs)
    inputs[0] = msgspec.structs.replace(inputs[0], max_tokens=HUGE)
    outcome = next(
        k for k, r in enumerate(recs) if any(isinstance(e, ev.StepExecuted) for e in r.inputs)
    )
    swapped = [recs[1].decisions[1], recs[1].decisions[0], *recs[1].decisions[2:]]
    return {
        "dropped decision": (edit(payloads, 3, decisions=list(recs[2].decisions[:-1])), 3),
        "swapped decisions": (edit(payloads, 2, decisions=swapped), 2),
        "huge max_tokens": (edit(payloads, arrival + 1, inputs=inputs), None),
        "dropped outcome": (edit(payloads, outcome + 1, inputs=[]), outcome + 1),
        "clock": (edit(payloads, 4, clock=recs[3].clock + 1.0), 4),
        "nan clock": (edit(payloads, 4, clock=math.nan), 4),
        "step number": (edit(payloads, 2, step=HUGE), 2),
        "plan digest": (edit(payloads, 2, plan=bytes(len(recs[1].plan))), 2),
        "short plan digest": (edit(payloads, 2, plan=recs[1].plan[:12]), 2),
        "dropped record": (payloads[:2] + payloads[3:], 3),
        "duplicated record": (payloads[:3] + payloads[2:], 4),
        "garbage payload": ([*payloads[:4], b"\xc1garbage", *payloads[5:]], 5),
    }


CLI_MUTATIONS = [
    "dropped decision",
    "swapped decisions",
    "huge max_tokens",
    "dropped outcome",
    "clock",
    "nan clock",
    "plan digest",
    "short plan digest",
]
DAMAGING_MUTATIONS = ["step number", "dropped record", "duplicated record", "garbage payload"]


@pytest.mark.parametrize("name", CLI_MUTATIONS)
def test_cli_verify_of_an_edited_log_exits_1_with_one_divergence_and_no_traceback(
    name: str,
    fixed_run: tuple[str, list[bytes], list[StepPlan]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):
    path, payloads, _ = fixed_run
    edited, step = cli_mutations(payloads)[name]
    bad = str(tmp_path / "edited.kvlog")
    write_log(path, bad, edited)

    code = kvsched.cli.main(["verify", bad, "--quiet"])

    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert out.strip().splitlines()[-1] == "1 divergence"
    assert re.search(rf"^divergence at step {step if step else '[0-9]+'}\b", out, re.M), out
    assert err == ""


@pytest.mark.parametrize("name", DAMAGING_MUTATIONS)
def test_cli_verify_of_a_log_with_a_damaged_record_exits_2_naming_its_offset_not_a_divergence(
    name: str,
    fixed_run: tuple[str, list[bytes], list[StepPlan]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):
    path, payloads, _ = fixed_run
    edited, step = cli_mutations(payloads)[name]
    assert step is not None
    bad = str(tmp_path / "edited.kvlog")
    offsets = write_log(path, bad, edited)

    code = kvsched.cli.main(["verify", bad, "--quiet"])

    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "divergence" not in out + err and "{" not in err and "Traceback" not in err
    assert err.startswith(f"kvsched: error: event log {bad} is corrupt at byte ")
    assert f"corrupt at byte {offsets[step - 1]}: the record " in err
    assert f"(the {step - 1} steps before it verified)" in err


def test_cli_verify_of_the_unedited_run_exits_0(
    fixed_run: tuple[str, list[bytes], list[StepPlan]], capsys: pytest.CaptureFixture[str]
):
    path, payloads, _ = fixed_run

    code = kvsched.cli.main(["verify", path, "--quiet"])

    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert out.strip().splitlines()[-1] == f"{len(payloads)} steps verified, 0 divergences"


# ------------------------------------------------------------ (3) a changed planner


def _one_changed(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        out = value.copy()
        out.flat[0] += 1
        out.setflags(write=False)
        return out
    return value + 1


PLANNER_FIELDS = ["slot_mapping", "positions", "block_tables", "num_decode_tokens"]


@pytest.mark.parametrize("field", PLANNER_FIELDS)
def test_a_planner_changed_from_step_n_on_is_reported_at_step_n_naming_the_changed_field(
    field: str,
    fixed_run: tuple[str, list[bytes], list[StepPlan]],
    monkeypatch: pytest.MonkeyPatch,
):
    path, _, plans = fixed_run
    # From the first step after the third one that computes a token (N >= 4).
    n = [p.step for p in plans if p.num_tokens][2] + 1
    n = next(p.step for p in plans if p.step >= n and p.num_tokens)
    assert n >= 4
    original = kvsched.engine.plan_step

    def changed_plan_step(state: Any) -> StepPlan:
        plan = original(state)
        if plan.step >= n and plan.num_tokens:
            plan = attrs.evolve(plan, **{field: _one_changed(getattr(plan, field))})
        return plan

    monkeypatch.setattr(kvsched.engine, "plan_step", changed_plan_step)
    result = verify_log(path)

    div = result.divergence
    assert div is not None
    assert (div.step, div.index, div.entity, div.field) == (n, -1, "plan", field)
    assert result.steps == n - 1
    assert f"divergence at step {n}: plan field {field!r} differs" in div.describe()
    assert div.logged is not None and div.new is not None
    assert div.logged["digest"] != div.new["digest"]
    changed = getattr(replayed_plan(path, n), field)
    shown = changed.tolist()[:16] if isinstance(changed, np.ndarray) else changed
    assert div.new["value"] == shown


def replayed_plan(path: str, step: int) -> StepPlan:
    """Step ``step``'s plan as the (changed) planner builds it, by a replay of the log."""
    engine = Engine(CONFIG)
    for payload in payloads_of(path)[:step]:
        rec = decode_record(payload)
        result = engine.step(rec.inputs, rec.clock)
    return result.plan


def test_an_unchanged_planner_wrapper_verifies(
    fixed_run: tuple[str, list[bytes], list[StepPlan]], monkeypatch: pytest.MonkeyPatch
):
    path, payloads, _ = fixed_run
    original = kvsched.engine.plan_step
    monkeypatch.setattr(kvsched.engine, "plan_step", lambda state: original(state))

    result = verify_log(path)

    assert result.ok and result.steps == len(payloads)


# ------------------------------------------ (4) logs this kvsched cannot replay: LogError


def header_log(
    path: str, schema_version: int, config: dict[str, Any], payloads: list[bytes]
) -> str:
    with EventLog.create(
        path, schema_version=schema_version, kvsched_version="x", config=config
    ) as log:
        for payload in payloads:
            log.append(payload)
    return path


def refused(path: str, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """verify_log's LogError message and what ``kvsched verify`` (exit 2) wrote to stderr."""
    with pytest.raises(LogError) as info:
        verify_log(path)
    capsys.readouterr()
    code = kvsched.cli.main(["verify", path, "--quiet"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in err and "divergence" not in out
    return str(info.value), err


def test_a_log_of_a_newer_schema_version_is_refused_naming_both_versions_and_to_upgrade(
    fixed_run: tuple[str, list[bytes], list[StepPlan]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):
    _, payloads, _ = fixed_run
    path = header_log(str(tmp_path / "v99.kvlog"), 99, CONFIG.to_dict(), payloads)

    message, err = refused(path, capsys)

    assert re.search(r"\bversion 99\b", message)
    assert re.search(rf"\bschema version {SCHEMA_VERSION}\b", message)
    assert "upgrade" in message
    assert message in err


def test_a_log_of_the_old_positional_schema_is_refused_naming_both_versions(
    fixed_run: tuple[str, list[bytes], list[StepPlan]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):
    old = [msgspec.msgpack.encode([1, 0.0, [], [["step", 1, 0.0]]])]  # positional arrays
    path = header_log(str(tmp_path / "v1.kvlog"), 1, CONFIG.to_dict(), old)

    message, err = refused(path, capsys)

    assert re.search(r"\bversion 1\b", message)
    assert re.search(rf"\bversion {SCHEMA_VERSION}\b", message)
    assert message in err


@pytest.mark.parametrize(
    "change",
    [
        {"block_size": 0},
        {"block_size": "8"},
        {"num_blocks": 1},
        {"order": "random"},
        {"bogus": 1},
        {"model": {"vocab_size": VOCAB, "bogus": 1}},
        {"model": 5},
        {"decode_checkpoint_interval": 6},
        {"num_blocks": 2**62},  # an engine too big to build
    ],
    ids=repr,
)
def test_a_log_whose_header_config_is_invalid_is_refused_with_exit_2(
    change: dict[str, Any],
    fixed_run: tuple[str, list[bytes], list[StepPlan]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):
    _, payloads, _ = fixed_run
    config = {**CONFIG.to_dict(), **change}
    path = header_log(str(tmp_path / "bad-config.kvlog"), SCHEMA_VERSION, config, payloads)

    message, err = refused(path, capsys)

    assert "config" in message
    assert message in err


def header_values(old: Any) -> list[Any]:
    """Other values for a header config entry (none of them allocates more than a few MiB
    when it is valid: 2**62 is refused by numpy at once)."""
    if isinstance(old, bool):
        return [not old, "yes", 2, None]
    if isinstance(old, int):
        return [old + 1, old - 1, 0, -1, 2**62, str(old), old + 0.5, None, [old]]
    if isinstance(old, float):
        return [-1.0, 0.0, math.nan, math.inf, "x"]
    return ["", "bogus", 3, None]


@settings(max_examples=max(30, settings.default.max_examples), deadline=None)
@given(data=st.data())
def test_any_edit_of_the_header_config_is_verified_diverges_or_is_a_log_error(
    data: st.DataObject,
):
    base = CONFIG.to_dict()
    keys = [("model", k) for k in base["model"]] + [(k, None) for k in base if k != "model"]
    key, sub = data.draw(st.sampled_from(keys), label="key")
    old = base[key][sub] if sub is not None else base[key]
    op = data.draw(st.sampled_from(["set", "set", "drop", "add"]), label="op")
    config = {**base, "model": dict(base["model"])}
    target = config["model"] if sub is not None else config
    name = sub if sub is not None else key
    if op == "drop":
        del target[name]
    elif op == "add":
        target["bogus_" + name] = 1
    else:
        target[name] = data.draw(st.sampled_from(header_values(old)), label="value")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "run.kvlog")
        record(src, CONFIG, SCHEDULE)
        path = header_log(
            os.path.join(tmp, "edited.kvlog"), SCHEMA_VERSION, config, payloads_of(src)
        )
        got = verify_totally(path)
    assert not isinstance(got, CorruptLogError), got
    if isinstance(got, VerifyResult):
        event("verified" if got.ok else "divergence")
    else:
        event("LogError")


# ---------------------------------------------- (5) a record that does not decode


def test_a_record_that_does_not_decode_is_a_corrupt_log_at_its_byte_offset_not_a_divergence(
    fixed_run: tuple[str, list[bytes], list[StepPlan]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):
    path, payloads, _ = fixed_run
    step = 5
    garbage = b"\x93\xff\x00garbage that is no msgpack map"
    with pytest.raises(RecordDecodeError):
        decode_record(garbage)
    bad = str(tmp_path / "garbage.kvlog")
    offsets = write_log(path, bad, [*payloads[: step - 1], garbage, *payloads[step:]])

    with pytest.raises(CorruptLogError) as info:
        verify_log(bad)

    assert info.value.offset == offsets[step - 1] and info.value.steps == step - 1
    assert info.value.reason.startswith(f"the record of step {step} is not a step record")
    code = kvsched.cli.main(["verify", bad, "--quiet"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert f"corrupt at byte {offsets[step - 1]}: the record of step {step} is not" in err


def test_a_record_holding_a_map_where_an_event_is_expected_is_corrupt_not_a_divergence(
    fixed_run: tuple[str, list[bytes], list[StepPlan]], tmp_path: Path
):
    path, payloads, _ = fixed_run
    raw = msgspec.msgpack.decode(payloads[2])
    raw["decisions"][0] = {"seq_id": 1, "note": "not an event"}  # a map with no type tag
    bad = str(tmp_path / "map.kvlog")
    offsets = write_log(path, bad, [*payloads[:2], msgspec.msgpack.encode(raw), *payloads[3:]])

    with pytest.raises(CorruptLogError) as info:
        verify_log(bad)

    assert (info.value.offset, info.value.steps) == (offsets[2], 2)
    assert "the record of step 3 is not a step record" in str(info.value)


# ----------------------------------------------------------------- known bugs (src)


def test_a_record_whose_array_field_is_not_an_array_is_corrupt_not_an_exception(
    tmp_path: Path,
):
    path = str(tmp_path / "list-prompt.kvlog")
    arrival = {"type": "arrived", "seq_id": 0, "prompt": [1, 2, 3], "max_tokens": 1}
    record_ = {"step": 1, "clock": 0.0, "inputs": [arrival], "decisions": []}
    header_log(path, SCHEMA_VERSION, CONFIG.to_dict(), [msgspec.msgpack.encode(record_)])

    with pytest.raises(CorruptLogError) as info:
        verify_log(path)

    assert info.value.steps == 0 and "the record of step 1 is not" in info.value.reason


def test_a_log_whose_config_is_too_large_to_allocate_is_refused_with_a_log_error(
    tmp_path: Path,
):
    # 2**48 blocks take 256 TiB or more in any dtype: beyond a 47-bit address space, whatever
    # the overcommit policy (and below the 2**63 bytes at which numpy says "array is too big").
    config = {**CONFIG.to_dict(), "num_blocks": 2**48}
    path = header_log(str(tmp_path / "huge.kvlog"), SCHEMA_VERSION, config, [])

    with pytest.raises(LogError):
        verify_log(path)


@pytest.mark.parametrize("seq_ids", [np.array([np.nan]), np.array(["x"])], ids=["nan", "str"])
def test_a_logged_decision_with_non_integer_seq_ids_is_a_divergence_not_an_exception(
    seq_ids: np.ndarray, fixed_run: tuple[str, list[bytes], list[StepPlan]], tmp_path: Path
):
    path, payloads, _ = fixed_run
    rec = decode_record(payloads[0])
    index = next(i for i, d in enumerate(rec.decisions) if isinstance(d, ev.BlocksAllocated))
    decisions = list(rec.decisions)
    decisions[index] = msgspec.structs.replace(decisions[index], seq_ids=seq_ids)
    bad = str(tmp_path / "edited.kvlog")
    write_log(path, bad, edit(payloads, 1, decisions=decisions))

    result = verify_log(bad)

    div = result.divergence
    assert div is not None and (div.step, div.index) == (1, index)


DEEP = b"\x91" * 100_000 + b"\xc0"  # msgpack: 100,000 nested one-element arrays around nil


def with_deep_junk_key(payload: bytes) -> bytes:
    """A msgpack fixmap payload with one more key, ``junk``, whose value is DEEP."""
    assert 0x80 <= payload[0] < 0x8F
    return bytes([payload[0] + 1]) + payload[1:] + b"\xa4junk" + DEEP


def test_a_record_with_a_deeply_nested_unknown_field_is_corrupt_not_an_exception(
    fixed_run: tuple[str, list[bytes], list[StepPlan]], tmp_path: Path
):
    path, payloads, _ = fixed_run
    bad = str(tmp_path / "deep.kvlog")
    offsets = write_log(path, bad, [*payloads[:2], with_deep_junk_key(payloads[2]), *payloads[3:]])

    with pytest.raises(CorruptLogError) as info:
        verify_log(bad)

    assert (info.value.offset, info.value.steps) == (offsets[2], 2)


def test_a_header_with_a_deeply_nested_extra_key_is_a_documented_log_error(tmp_path: Path):
    header = msgspec.msgpack.encode(
        {"schema_version": SCHEMA_VERSION, "kvsched_version": "x", "config": CONFIG.to_dict()}
    )
    path = tmp_path / "deep-header.kvlog"
    path.write_bytes(MAGIC + encode_frame(with_deep_junk_key(header)))

    with pytest.raises((CorruptLogError, LogError)):
        verify_log(str(path))


def test_a_record_stripped_of_its_plan_digest_is_corrupt(
    tmp_path: Path, fixed_run: tuple[str, list[bytes], list[StepPlan]]
):
    path, payloads, _ = fixed_run
    k = len(payloads) // 2
    stripped = msgspec.structs.replace(decode_record(payloads[k]), plan=b"")
    bad = str(tmp_path / "stripped.kvlog")
    offsets = write_log(path, bad, [*payloads[:k], encode(stripped), *payloads[k + 1 :]])
    with pytest.raises(CorruptLogError) as info:
        verify_log(bad)
    assert (info.value.offset, info.value.steps) == (offsets[k], k)
    assert f"the record of step {k + 1} carries no plan digest" in str(info.value)
