"""The benchmarks run end to end on small shapes (their numbers are in docs/benchmarks.md)."""

import gc
import json
import tempfile
from pathlib import Path

import pytest

from kvsched.bench.admit import run_admit_bench
from kvsched.bench.identity import run_identity_bench
from kvsched.bench.match import run_match_bench
from kvsched.bench.stats import time_samples
from kvsched.bench.step import bench_config, run_step_bench, setup_bound
from kvsched.cli import main
from kvsched.config import MAX_TABLE_ENTRIES
from kvsched.events import types as ev
from kvsched.events.codec import decode_record
from kvsched.events.log import read_log


def test_the_match_benchmark_hits_every_token_and_reports_percentiles() -> None:
    out = run_match_bench(mode="ar", batch=3, context=1024, warmup=1, samples=3)
    assert out["impl"] == "kvsched" and out["mode"] == "ar"
    assert (out["batch"], out["context"]) == (3, 1024)
    assert 0 < out["p50_ms"] <= out["p99_ms"]


@pytest.mark.parametrize("mode", ["ar", "ssm"])
def test_the_admit_benchmark_admits_every_request_with_its_whole_hit(mode: str) -> None:
    # undo asserts that all 3 hit 1,024 tokens (ssm: from a checkpoint) and then finish
    out = run_admit_bench(mode=mode, batch=3, context=1024, warmup=1, samples=3)
    assert (out["bench"], out["mode"], out["identity"]) == ("admit", mode, "kvs128")
    assert 0 < out["p50_ms"] <= out["p99_ms"]


def test_the_admit_benchmark_refuses_a_context_that_is_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of the block size"):
        run_admit_bench(mode="ar", batch=1, context=1000)


@pytest.mark.parametrize("scheme", ["kvs128", "blake2b"])
def test_the_identity_benchmark_reports_the_hash_beside_one_array_equal_pass(scheme: str) -> None:
    out = run_identity_bench(context=4096, scheme=scheme, warmup=2, samples=20)
    assert out["scheme"] == scheme and out["context"] == 4096
    assert 0 < out["p50_ms"] <= out["p99_ms"] and out["array_equal_p50_ms"] > 0
    assert out["ns_per_token_p50"] == pytest.approx(out["p50_ms"] * 1e6 / 4096, rel=0.01)


def test_the_step_benchmark_times_steps_where_every_sequence_decodes() -> None:
    out = run_step_bench(running=16, prompt=100, warmup=2, samples=20)
    assert out["running"] == 16 and out["event_log"] is False
    assert 0 < out["p50_ms"] <= out["p99_ms"]


def test_the_step_benchmark_sizes_max_tokens_from_a_set_up_of_many_steps() -> None:
    # 2 prompts of 4,096 tokens per step: the set-up admits 128 sequences over 64 steps, and
    # the first admitted decode all the while; none may finish while timed (feed asserts it).
    out = run_step_bench(running=128, prompt=4096, warmup=1, samples=40)
    assert out["running"] == 128
    assert 64 <= out["setup_steps"] <= setup_bound(128, 4096)


def test_the_step_benchmark_config_holds_16384_running_sequences() -> None:
    # (a context of 1 << 21 made the block tables exceed MAX_TABLE_ENTRIES from 8,192 on)
    config, max_tokens = bench_config(16384, 512, 5, 200)
    assert config.max_batch == 16384
    assert max_tokens >= setup_bound(16384, 512) + 5 + 200 and setup_bound(16384, 512) <= 68
    assert config.max_batch * (config.model.max_context // 64 + 1) <= MAX_TABLE_ENTRIES // 100
    assert config.num_blocks >= 16384 * -(-(512 + max_tokens) // 64)


def test_the_step_benchmark_with_an_event_log_writes_one_record_per_timed_step(
    tmp_path: Path,
) -> None:
    path = tmp_path / "step.kvlog"
    out = run_step_bench(running=16, prompt=100, warmup=2, samples=5, log_path=str(path))
    assert out["event_log"] is True and out["record_kib"] > 0
    records = read_log(path).records
    assert len(records) == out["setup_steps"] + 2 + 5  # the set-up's steps, then the timed
    for payload in records[-7:]:
        record = decode_record(payload)
        (outcome,) = record.inputs
        assert isinstance(outcome, ev.StepExecuted) and len(outcome.seq_ids) == 16
        decodes = [d for d in record.decisions if isinstance(d, ev.DecodeScheduled)]
        assert [len(d.seq_ids) for d in decodes] == [16]
        assert record.plan  # the plan digest is part of the timed record


def test_the_step_benchmark_deletes_its_temporary_event_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = run_step_bench(running=4, prompt=100, warmup=0, samples=3, event_log=True)
    assert out["event_log"] is True
    assert list(tmp_path.iterdir()) == []


def test_bench_json_prints_one_json_line(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "step", "--running", "4", "--samples", "5", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and {"p50_ms", "p99_ms"} <= json.loads(lines[0]).keys()


def test_timing_with_the_set_up_frozen_keeps_every_sample_and_unfreezes_afterwards() -> None:
    calls: list[int] = []
    times = time_samples(
        lambda: calls.append(gc.get_freeze_count()), lambda: None, 1, 3, freeze=True
    )
    assert len(times) == 3 and len(calls) == 4 and min(calls) > 0
    assert gc.get_freeze_count() == 0
