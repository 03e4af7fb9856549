"""The benchmarks run end to end on small shapes (their numbers are in docs/benchmarks.md)."""

import json

from kvsched.bench.match import run_match_bench
from kvsched.bench.step import run_step_bench
from kvsched.cli import main


def test_the_match_benchmark_hits_every_token_and_reports_percentiles() -> None:
    out = run_match_bench(mode="ar", batch=3, context=1024, warmup=1, samples=3)
    assert out["impl"] == "kvsched" and out["mode"] == "ar"
    assert (out["batch"], out["context"]) == (3, 1024)
    assert 0 < out["p50_ms"] <= out["p99_ms"]


def test_the_step_benchmark_times_steps_where_every_sequence_decodes() -> None:
    out = run_step_bench(running=16, prompt=100, warmup=2, samples=20)
    assert out["running"] == 16
    assert 0 < out["p50_ms"] <= out["p99_ms"]


def test_bench_json_prints_one_json_line(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "step", "--running", "4", "--samples", "5", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and {"p50_ms", "p99_ms"} <= json.loads(lines[0]).keys()
