"""Record-and-verify: recorded runs replay without divergence; changed policies and damaged
logs are reported precisely; the ``kvsched demo`` / ``kvsched verify`` command line."""

from __future__ import annotations

import os
import struct
import tempfile
import tracemalloc
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import msgspec
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from tests.replay.log_helpers import write_log

import kvsched.cli
import kvsched.replay.verify
from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine, create_log
from kvsched.events import types as ev
from kvsched.events.codec import StepRecord, decode_record, encode
from kvsched.events.log import EventLog, read_log
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.headers import FLAT_NAMES
from kvsched.policy import Policy
from kvsched.policy.scheduler import Chunk
from kvsched.reducers.sequences import Seq
from kvsched.replay.verify import verify_log

Schedule = Mapping[int, Sequence[ev.Event]]


def record_run(
    path: str, config: SchedulerConfig, schedule: Schedule, max_steps: int = 5000
) -> Engine:
    """Run ``schedule`` (engine step -> inputs) to completion, recording to ``path``."""
    log = create_log(path, config)
    engine = Engine(config, log=log, check_invariants=True)
    executor = SimulatedExecutor(config.model.vocab_size)
    last_input = max(schedule, default=0)
    outcome: list[ev.Event] = []
    clock = 0.0
    try:
        for n in range(1, max_steps + 1):
            if n > last_input and not outcome and not engine.has_work:
                return engine
            inputs = [*outcome, *schedule.get(n, ())]
            inputs = [
                msgspec.structs.replace(e, arrival_time=clock)
                if isinstance(e, ev.RequestArrived)
                else e
                for e in inputs
            ]
            result = engine.step(inputs, clock)
            outcome = []
            if result.plan.is_empty and len(result.decisions) == 1 and n >= last_input:
                # Nothing decided, nothing to run and no input to come: every later step
                # would be the same (the clock only moves with executed work).
                assert not engine.has_work, f"engine stalled at step {n} with work left"
            if not result.plan.is_empty:
                executed = executor.execute(result.plan)
                outcome = [executed]
                clock += executed.duration_s
        raise AssertionError(f"workload still running after {max_steps} steps")
    finally:
        log.close()


def logged_records(path: str) -> list[StepRecord]:
    return [decode_record(r) for r in read_log(path).records]


def arrive(seq_id: int, prompt: np.ndarray, max_tokens: int, **kw: object) -> ev.RequestArrived:
    return ev.RequestArrived(seq_id, np.asarray(prompt, np.int32), max_tokens, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------- (a) property


MAX_TOKENS = 24


@st.composite
def workloads(draw: st.DrawFn) -> tuple[SchedulerConfig, dict[int, list[ev.Event]]]:
    vocab = 64
    bs = draw(st.sampled_from([4, 8]))
    config = SchedulerConfig.from_dict(
        dict(
            model=ModelSpec(vocab_size=vocab, max_context=256),
            block_size=bs,
            num_blocks=draw(st.integers(8, 28)),  # small: forces preemption
            max_batch=draw(st.integers(1, 5)),
            max_prefill_tokens=bs * draw(st.integers(1, 4)),
            order=draw(st.sampled_from(["fcfs", "priority", "ttft"])),
            turn_mode=draw(st.sampled_from(["mixed", "alternate"])),
            enable_prefix_caching=draw(st.booleans()),
        )
    )
    token = st.integers(0, vocab - 1)
    prefix_tokens = st.lists(token, min_size=bs, max_size=3 * bs)
    prefixes = draw(st.lists(prefix_tokens, min_size=1, max_size=3))
    schedule: dict[int, list[ev.Event]] = {}
    n_requests = draw(st.integers(1, 8))
    for seq_id in range(n_requests):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(token, min_size=1, max_size=2 * bs))
        request = arrive(
            seq_id,
            np.array(prefix + suffix),
            draw(st.integers(1, MAX_TOKENS)),
            priority=draw(st.integers(0, 2)),
            session_id=draw(st.sampled_from([-1, -1, 0, 1])),
            eos_token_id=draw(st.sampled_from([-1, -1, 7])),
        )
        schedule.setdefault(draw(st.integers(1, 12)), []).append(request)
    for _ in range(draw(st.integers(0, 3))):
        abort = ev.RequestAborted(draw(st.integers(0, n_requests)))  # may be unknown/finished
        schedule.setdefault(draw(st.integers(1, 20)), []).append(abort)
    if draw(st.booleans()):
        schedule.setdefault(draw(st.integers(1, 20)), []).append(ev.SessionEnded(0))
    if draw(st.booleans()):
        at = draw(st.integers(1, 15))
        schedule.setdefault(at, []).append(ev.DrainRequested())
        schedule.setdefault(at + draw(st.integers(1, 5)), []).append(ev.WakeRequested())
    return config, schedule


# At least 150 examples (about 5 s); HYPOTHESIS_PROFILE=deep runs the profile's many more.
@settings(max_examples=max(150, settings.default.max_examples), deadline=None)
@given(workloads())
def test_any_recorded_run_verifies_with_zero_divergences(
    case: tuple[SchedulerConfig, dict[int, list[ev.Event]]],
):
    config, schedule = case
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.kvlog")
        engine = record_run(path, config, schedule)
        result = verify_log(path)

    stats = engine.state.stats
    event(f"preempted: {stats.preemptions > 0}")
    event(f"prefix hit: {stats.hit_tokens > 0}")
    event(f"rejected: {stats.requests_rejected > 0}")
    event(f"aborted: {stats.requests_aborted > 0}")
    assert result.divergence is None, result.divergence.describe()
    assert result.torn_tail is None
    assert result.steps == engine.state.step
    assert result.config == config


def test_a_small_cache_run_with_preemptions_and_aborts_verifies_with_zero_divergences(
    tmp_path: Path,
):
    rng = np.random.default_rng(3)
    config = SchedulerConfig(
        model=ModelSpec(vocab_size=64, max_context=256),
        block_size=4,
        num_blocks=16,
        max_batch=4,
        max_prefill_tokens=8,
    )
    shared = rng.integers(0, 64, 9)
    schedule: dict[int, list[ev.Event]] = {}
    for i in range(8):
        prompt = np.concatenate([shared, rng.integers(0, 64, int(rng.integers(1, 12)))])
        schedule.setdefault(1 + i // 2, []).append(arrive(i, prompt, 10 + i))
    schedule[6] = [ev.RequestAborted(2), ev.RequestAborted(99)]
    path = str(tmp_path / "run.kvlog")

    engine = record_run(path, config, schedule)
    result = verify_log(path)

    stats = engine.state.stats
    assert stats.preemptions > 0 and stats.hit_tokens > 0  # the run exercised both
    assert stats.requests_aborted == 1 and stats.requests_finished == 7
    assert result.ok and result.steps == engine.state.step


# Config keys that logs before schema 4 did not record (from_log_header pins them).
_SCHEMA4_KEYS = (
    "identity",
    "checkpoint_min_gain_blocks",
    "keep_aborted_turns",
    "session_reclaim",
    "mtp_overlap",
    "multimodal_safe",
)


def _mtp_images_schedule(seed: int) -> dict[int, list[ev.Event]]:
    """Requests sharing a prefix with an image across the 64-token chunk boundary, under
    memory pressure (preemptions), one aborted."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 1000, 100, dtype=np.int32)
    image = (ev.MultimodalSpan(40, 90, b"image"),)
    schedule: dict[int, list[ev.Event]] = {}
    for i in range(10):
        prompt = np.concatenate([shared, rng.integers(1, 1000, int(rng.integers(1, 40)))])
        schedule.setdefault(1 + i, []).append(
            arrive(i, prompt, 8 + 2 * i, mm_spans=image, session_id=i if i % 3 == 0 else -1)
        )
    schedule[12] = [ev.RequestAborted(3)]
    return schedule


def _without(config: dict[str, Any], flat_names: tuple[str, ...]) -> dict[str, Any]:
    """A header config without the settings of these flat names (wherever they sit)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for flat in flat_names:
        sub, name = FLAT_NAMES.get(flat, ("", flat))
        (out[sub] if sub else out).pop(name, None)
    return out


def _mtp_config(**overrides: object) -> SchedulerConfig:
    config = SchedulerConfig.from_dict({**CONFIG.to_dict(), "num_speculative_tokens": 2})
    return attrs.evolve(config, num_blocks=20, **overrides)


def test_a_run_with_mtp_overlaps_and_multimodal_spans_verifies_with_zero_divergences(
    tmp_path: Path,
):
    path = str(tmp_path / "run.kvlog")
    engine = record_run(path, _mtp_config(), _mtp_images_schedule(1))
    result = verify_log(path)
    records = [decode_record(p) for p in read_log(path).records]
    overlaps = [
        d
        for r in records
        for d in r.decisions
        if isinstance(d, ev.PrefixMatched) and d.overlap_block
    ]
    assert overlaps and engine.state.stats.preemptions > 0  # the run exercised both
    assert result.ok and result.steps == engine.state.step


def test_an_mtp_log_with_images_from_before_schema_4_verifies_with_the_rules_it_ran(
    tmp_path: Path,
):
    recorded = str(tmp_path / "recorded.kvlog")
    # What kvsched before schema 4 ran: k blocks recomputed, spans split (and the rest of
    # what from_log_header pins for old logs).
    old_rules = SchedulerConfig.from_log_header(_without(_mtp_config().to_dict(), _SCHEMA4_KEYS), 3)
    assert old_rules.legacy.mtp_overlap == "k_blocks" and not old_rules.legacy.multimodal_safe
    record_run(recorded, old_rules, _mtp_images_schedule(2))
    contents = read_log(recorded)
    # (the other pinned keys stay: read as schema 4, only these two rules can differ)
    old_header = _without(contents.header["config"], ("mtp_overlap", "multimodal_safe"))
    for version, ok in ((3, True), (4, False)):
        path = str(tmp_path / f"schema{version}.kvlog")
        with EventLog.create(
            path, schema_version=version, kvsched_version="0", config=old_header
        ) as log:
            for payload in contents.records:
                log.append(payload)
        assert verify_log(path).ok == ok  # read as schema 4, the new rules decide otherwise


# ---------------------------------------------------------- (b) changed policy

CONFIG = SchedulerConfig(
    model=ModelSpec(vocab_size=1000, max_context=1024),
    block_size=16,
    num_blocks=256,
    max_batch=8,
    max_prefill_tokens=64,
)
SMALL_CHUNK = 16


class SmallerChunks(Policy):
    """Prefills in chunks of 16 tokens instead of the configured 64."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.admission.chunk_of = self.small_chunk  # type: ignore[method-assign]

    def small_chunk(self, seq: Seq, start: int, branch: int = -1) -> Chunk:
        end = min(seq.n_tokens, (start // SMALL_CHUNK + 1) * SMALL_CHUNK)
        return Chunk(start, end, end == seq.n_tokens)


class PriorityFirst(Policy):
    """Admits waiting requests by priority instead of the configured arrival order."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(attrs.evolve(config, order="priority"))


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 1000, n, dtype=np.int32)


def test_a_policy_with_smaller_chunks_diverges_at_the_first_prefill_longer_than_its_chunk(
    tmp_path: Path,
):
    # Short prompts (<= 16 tokens: identical chunks either way) arrive over steps 1-5,
    # a 40-token prompt at step 6 and another short one at step 8.
    schedule = {n: [arrive(n, tokens(5 + 2 * n, n), 12)] for n in range(1, 6)}
    schedule[6] = [arrive(6, tokens(40, 6), 4)]
    schedule[8] = [arrive(8, tokens(9, 8), 4)]
    path = str(tmp_path / "run.kvlog")
    record_run(path, CONFIG, schedule)
    records = logged_records(path)

    # Independently: the first logged prefill chunk the smaller chunk size cannot produce.
    expected = None
    for record in records:
        for d in record.decisions:
            if isinstance(d, ev.PrefillScheduled):
                long = (d.ends - d.starts) > SMALL_CHUNK
                if long.any():
                    expected = (record.step, int(d.seq_ids[np.argmax(long)]))
                    break
        if expected is not None:
            break
    assert expected == (6, 6)
    step, seq_id = expected
    logged = records[step - 1].decisions
    # Admission is the same; the first decision sized by the chunk is the block allocation.
    index = next(
        i
        for i, d in enumerate(logged)
        if isinstance(d, ev.BlocksAllocated) and d.seq_ids.tolist() == [seq_id]
    )

    result = verify_log(path, policy_factory=SmallerChunks)

    div = result.divergence
    assert div is not None
    assert (div.step, div.index, div.entity) == (step, index, f"seq_ids=[{seq_id}]")
    assert result.steps == step - 1
    assert div.logged is not None and div.new is not None
    assert div.logged["type"] == div.new["type"] == "BlocksAllocated"
    assert (div.logged["counts"], div.new["counts"]) == ([3], [1])  # 40 vs 16 tokens


def test_a_policy_with_smaller_chunks_does_not_diverge_while_no_prompt_exceeds_its_chunk(
    tmp_path: Path,
):
    schedule = {n: [arrive(n, tokens(5 + 2 * n, n), 12)] for n in range(1, 6)}
    path = str(tmp_path / "run.kvlog")
    record_run(path, CONFIG, schedule)

    result = verify_log(path, policy_factory=SmallerChunks)

    assert result.ok and result.steps == len(logged_records(path))


def test_a_priority_ordering_diverges_at_the_first_admission_where_priority_and_arrival_disagree(
    tmp_path: Path,
):
    # Step 1: two arrivals whose priority order agrees with arrival order (no divergence);
    # step 5: seq 11 (priority 3) arrives together with, but after, seq 10 (priority 0).
    schedule = {
        1: [arrive(0, tokens(20, 0), 8, priority=2), arrive(1, tokens(20, 1), 8)],
        3: [arrive(2, tokens(20, 2), 8, priority=1)],
        5: [arrive(10, tokens(20, 10), 8), arrive(11, tokens(20, 11), 8, priority=3)],
    }
    path = str(tmp_path / "run.kvlog")
    record_run(path, CONFIG, schedule)
    records = logged_records(path)

    # Independently: the first step whose admissions are not in priority order.
    priority: dict[int, int] = {}
    expected = None
    for record in records:
        for e in record.inputs:
            if isinstance(e, ev.RequestArrived):
                priority[e.seq_id] = e.priority
        admitted = [
            (i, d.seq_id)
            for i, d in enumerate(record.decisions)
            if isinstance(d, ev.SequenceAdmitted)
        ]
        ranked = sorted(admitted, key=lambda a: -priority[a[1]])  # stable: ties keep order
        if ranked != admitted:
            expected = (record.step, admitted[0][0], admitted[0][1])
            break
    assert expected is not None and expected[0] == 5 and expected[2] == 10

    result = verify_log(path, policy_factory=PriorityFirst)

    div = result.divergence
    assert div is not None
    assert (div.step, div.index, div.entity) == (expected[0], expected[1], "seq_id=10")
    assert div.logged is not None and div.new is not None
    assert div.logged["type"] == div.new["type"] == "SequenceAdmitted"
    assert (div.logged["seq_id"], div.new["seq_id"]) == (10, 11)


def rewrite_log(src: str, dst: str, records: list[StepRecord]) -> None:
    write_log(src, dst, [encode(record) for record in records])


def short_run(tmp_path: Path) -> tuple[str, list[StepRecord]]:
    path = str(tmp_path / "run.kvlog")
    record_run(path, CONFIG, {1: [arrive(0, tokens(30, 0), 6), arrive(1, tokens(10, 1), 3)]})
    return path, logged_records(path)


def test_an_edited_logged_decision_is_reported_at_its_step_and_entity(tmp_path: Path):
    path, records = short_run(tmp_path)
    found = [
        (r.step, i)
        for r in records
        for i, d in enumerate(r.decisions)
        if isinstance(d, ev.SequenceFinished)
    ]
    step, index = found[0]
    target = records[step - 1]
    finished = target.decisions[index]
    assert isinstance(finished, ev.SequenceFinished)
    edited = list(target.decisions)
    edited[index] = msgspec.structs.replace(finished, reasons=("stop",) * len(finished.reasons))
    records[step - 1] = msgspec.structs.replace(target, decisions=edited)
    bad = str(tmp_path / "edited.kvlog")
    rewrite_log(path, bad, records)

    result = verify_log(bad)

    div = result.divergence
    assert div is not None
    assert (div.step, div.index) == (step, index)
    assert div.entity == f"seq_ids=[{','.join(map(str, finished.seq_ids.tolist()))}]"
    assert div.logged is not None and div.new is not None
    assert set(div.logged["reasons"]) == {"stop"} and set(div.new["reasons"]) == {"length"}


def test_a_log_missing_an_executor_outcome_is_reported_as_an_engine_divergence(tmp_path: Path):
    path, records = short_run(tmp_path)
    records[2] = msgspec.structs.replace(records[2], inputs=[])  # drop step 2's outcome
    bad = str(tmp_path / "missing.kvlog")
    rewrite_log(path, bad, records)

    result = verify_log(bad)

    div = result.divergence
    assert div is not None
    assert (div.step, div.index, div.entity) == (3, -1, "engine")
    assert div.logged is not None and "outcome of step 2" in str(div.logged["error"])
    assert "is missing" in str(div.logged["error"])
    assert result.steps == 2


def test_a_log_with_extra_trailing_decisions_is_reported_where_the_replay_has_none(
    tmp_path: Path,
):
    path, records = short_run(tmp_path)
    last = records[-1]
    records[-1] = msgspec.structs.replace(last, decisions=[*last.decisions, ev.Woken()])
    bad = str(tmp_path / "extra.kvlog")
    rewrite_log(path, bad, records)

    div = verify_log(bad).divergence

    assert div is not None
    assert (div.step, div.index, div.entity) == (last.step, len(last.decisions), "engine")
    assert div.logged == {"type": "Woken"} and div.new is None


# ------------------------------------------------------------------------ (c) CLI

DEMO = ["--sessions", "8", "--turns", "2", "--quiet"]


def demo_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = tmp_path / "run.kvlog"
    assert kvsched.cli.main(["demo", "--log", str(path), *DEMO]) == 0
    capsys.readouterr()
    return path


def test_cli_demo_log_then_verify_reports_zero_divergences_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = demo_log(tmp_path, capsys)
    n_records = len(read_log(path).records)

    code = kvsched.cli.main(["verify", str(path), "--quiet"])

    out, err = capsys.readouterr()
    assert code == 0
    assert out.strip().splitlines()[-1] == f"{n_records} steps verified, 0 divergences"
    assert "torn tail" not in out
    assert err == ""


def test_cli_verify_of_a_log_cut_mid_record_reports_the_torn_tail_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = demo_log(tmp_path, capsys)
    contents = read_log(path)
    data = path.read_bytes()
    path.write_bytes(data[:-5])

    code = kvsched.cli.main(["verify", str(path), "--quiet"])

    out, _ = capsys.readouterr()
    complete = len(contents.records) - 1
    assert code == 0
    assert f"torn tail at byte {contents.offsets[-1]}" in out
    assert out.strip().splitlines()[-1] == f"{complete} steps verified, 0 divergences"


def test_cli_verify_of_a_log_with_a_flipped_byte_fails_naming_the_damaged_record_offset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = demo_log(tmp_path, capsys)
    offsets = read_log(path).offsets
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0x5A
    path.write_bytes(bytes(data))
    damaged = max(o for o in offsets if o <= middle)  # the frame holding the flipped byte

    code = kvsched.cli.main(["verify", str(path), "--quiet"])

    out, err = capsys.readouterr()
    assert code != 0
    assert f"corrupt at byte {damaged}" in err
    assert "0 divergences" not in out
    assert "Traceback" not in err


def test_cli_verify_of_a_log_with_a_middle_frame_claiming_4_gib_is_corrupt_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = demo_log(tmp_path, capsys)
    offsets = read_log(path).offsets
    data = bytearray(path.read_bytes())
    at = offsets[len(offsets) // 2]
    head = struct.pack("<II", 0xFFFF_FFF0, 0)
    data[at : at + 12] = head + struct.pack("<I", zlib.crc32(head))  # its own checksum holds
    path.write_bytes(bytes(data))

    code = kvsched.cli.main(["verify", str(path), "--quiet"])

    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert f"kvsched: error: event log {path} is corrupt at byte {at}: frame claims" in err
    assert f"(the {len(offsets) // 2} steps before it verified)" in err
    assert "torn tail" not in err and "divergence" not in err


def test_cli_verify_of_a_log_followed_by_zeros_reports_crash_padding_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = demo_log(tmp_path, capsys)
    steps = len(read_log(path).records)
    with path.open("ab") as f:
        f.write(bytes(4096))

    code = kvsched.cli.main(["verify", str(path), "--quiet"])

    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert out.splitlines() == [
        f"warning: {steps} complete steps, then 4096 zero bytes (crash padding)",
        f"{steps} steps verified, 0 divergences",
    ]


def long_prompt_log(path: Path, requests: int, prompt: int) -> None:
    """A log of ``requests`` arrivals of random ``prompt``-token prompts, one token each."""
    config = SchedulerConfig(
        model=ModelSpec(vocab_size=32000, max_context=2 * prompt),
        block_size=16,
        num_blocks=4 * prompt // 16,
        max_batch=2,
        max_prefill_tokens=prompt,
    )
    rng = np.random.default_rng(0)
    arrivals = {
        n: [ev.RequestArrived(n, rng.integers(0, 32000, prompt, dtype=np.int32), 1)]
        for n in range(1, requests + 1)
    }
    record_run(str(path), config, arrivals)


def test_verify_holds_a_record_at_a_time_not_the_log(tmp_path: Path):
    path = tmp_path / "long.kvlog"
    long_prompt_log(path, 100, 16384)  # about 64 KiB a record, 13 MB
    size = path.stat().st_size

    tracemalloc.start()
    try:
        result = verify_log(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert result.ok and result.steps > 100
    assert peak < size // 2, (size, peak)  # reading it whole takes twice its size


def test_ctrl_c_in_verify_says_how_many_steps_were_verified_and_exits_130(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    path = demo_log(tmp_path, capsys)
    replay_record = kvsched.replay.verify.replay_record

    def interrupted_at_step_3(engine: Engine, offset: int, payload: bytes, step: int, *a: bool):
        if step == 3:
            raise KeyboardInterrupt
        return replay_record(engine, offset, payload, step, *a)

    monkeypatch.setattr(kvsched.replay.verify, "replay_record", interrupted_at_step_3)

    code = kvsched.cli.main(["verify", str(path), "--quiet"])

    out, err = capsys.readouterr()
    assert code == 130 and out == ""
    assert err == "interrupted after 2 steps; 2 steps verified, 0 divergences so far\n"


def test_cli_verify_of_a_log_with_an_edited_decision_describes_the_divergence_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path, records = short_run(tmp_path)
    records[1] = msgspec.structs.replace(records[1], clock=records[1].clock + 1.0)
    bad = str(tmp_path / "edited.kvlog")
    rewrite_log(path, bad, records)

    code = kvsched.cli.main(["verify", bad, "--quiet"])

    out, _ = capsys.readouterr()
    assert code == 1
    assert "divergence at step 2, decision #0, engine:" in out
    assert out.strip().splitlines()[-1] == "1 divergence"


def test_cli_verify_of_a_missing_log_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = tmp_path / "nope.kvlog"

    code = kvsched.cli.main(["verify", str(path), "--quiet"])

    _, err = capsys.readouterr()
    assert code == 2
    assert str(path) in err and "No such file" in err
