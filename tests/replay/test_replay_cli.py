"""``kvsched replay``, ``kvsched diff`` and the demo's shared replay path: metrics, reports,
deterministic logs, sweeps and failures with exit code 2."""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path

import pytest

import kvsched.cli
import kvsched.replay.setup
from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.events.codec import decode_record
from kvsched.events.log import read_log
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.replay.metrics import replay_workload
from kvsched.replay.report import PLOTS
from kvsched.replay.setup import parse_policies
from kvsched.replay.traces import read_mooncake

TRACES = Path(__file__).parents[2].parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_fast25_synthetic_trace.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def mooncake() -> Path:
    if not MOONCAKE.exists():
        pytest.skip(f"shared trace {MOONCAKE} is missing (expected next to the repository)")
    return MOONCAKE


def small_trace(tmp_path: Path) -> Path:
    """Six requests: three share a 1,024-token prefix."""
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 8, "hash_ids": [0, 1, 2]},
        {"timestamp": 400, "input_length": 1300, "output_length": 5, "hash_ids": [0, 1, 3]},
        {"timestamp": 800, "input_length": 300, "output_length": 9, "hash_ids": [4]},
        {"timestamp": 900, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 950, "input_length": 600, "output_length": 6, "hash_ids": [5, 6]},
        {"timestamp": 990, "input_length": 520, "output_length": 2, "hash_ids": [5, 7]},
    ]
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = kvsched.cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -------------------------------------------------------------------------- metrics


def test_replay_json_prints_one_object_with_the_headline_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    code, out, _ = run_cli(capsys, "replay", str(small_trace(tmp_path)), "--json", "--quiet")

    m = json.loads(out)
    assert code == 0 and out.count("\n") == 1
    for key in ("requests", "token_hit_rate", "ttft_p50_s", "ttft_p99_s", "throughput_tok_s"):
        assert key in m
    assert m["requests"] == 6 and m["finished"] == 6 and m["rejected"] == 0
    assert m["hit_rate_checkpoint"] == 0.0 and m["hit_rate_external"] == 0.0
    assert 0 < m["ttft_p50_s"] <= m["ttft_p99_s"]
    assert m["evictions"] == 0  # the default cache is unbounded
    # request 2 hits 1,024 of 1,300 tokens; request 4 hits 1,088 of 1,100; request 6 hits 512
    assert m["hit_tokens"] == 1024 + 1088 + 512
    assert m["token_hit_rate"] == pytest.approx(m["ideal_hit_rate"])


def test_replay_table_shows_requests_latencies_hit_rates_preemptions_and_evictions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    code, out, _ = run_cli(capsys, "replay", str(small_trace(tmp_path)), "--quiet")

    assert code == 0
    for label in (
        "requests",
        "TTFT p50 / p90 / p99",
        "TPOT p50 / p90 / p99",
        "local KV",
        "checkpoint",
        "external",
        "throughput",
        "preemptions",
        "evictions",
    ):
        assert label in out


def test_ttft_is_first_token_step_end_minus_arrival_on_the_simulated_clock(tmp_path: Path):
    trace = read_mooncake(small_trace(tmp_path))
    config = SchedulerConfig(model=ModelSpec(vocab_size=150_000), num_blocks=256)
    engine = Engine(config)

    result = replay_workload(engine, SimulatedExecutor(150_000), trace.workload)

    rec = result.recorder
    assert rec.arrival.tolist() == [0.0, 0.4, 0.8, 0.9, 0.95, 0.99]
    ttft, tpot, _ = rec.latencies()
    assert (ttft > 0).all() and (tpot > 0).all()
    # the first request runs alone: one 1,100-token prefill step, then its token exists
    cost = SimulatedExecutor(150_000).cost
    alone = cost.overhead_s + 1100 * cost.prefill_token_s + 1100 * cost.kv_token_s
    alone += 1100 * (0 + 1101 / 2) * cost.prefill_attn_s
    assert ttft[0] == pytest.approx(alone)
    assert rec.tokens.tolist() == [8, 5, 9, 3, 6, 2]


def test_too_small_cache_rejects_requests_and_the_summary_counts_them_by_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    code, out, _ = run_cli(
        capsys, "replay", str(small_trace(tmp_path)), "--cache-blocks", "12", "--json", "--quiet"
    )

    m = json.loads(out)
    assert code == 0 and m["rejected"] == 3 and m["finished"] == 3
    assert sum(m["rejections"].values()) == 3


# -------------------------------------------------------------------- report, plots


def test_report_writes_metrics_json_timeseries_and_three_png_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    report = tmp_path / "report"

    code, out, _ = run_cli(
        capsys, "replay", str(small_trace(tmp_path)), "--report", str(report), "--quiet"
    )

    assert code == 0 and str(report) in out
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics["requests"] == 6 and "ttft_p99_s" in metrics
    series = json.loads((report / "timeseries.json").read_text())
    assert {"clock", "waiting", "running", "held", "used", "hit_tokens"} <= set(series)
    for name in PLOTS:
        data = (report / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name


def test_sweep_runs_each_value_and_plots_hit_rate_and_ttft_against_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    report = tmp_path / "sweep"

    code, out, _ = run_cli(
        capsys,
        "replay",
        str(small_trace(tmp_path)),
        "--sweep",
        "cache-blocks=24,64,256",
        "--report",
        str(report),
        "--json",
        "--quiet",
    )

    data = json.loads(out)
    assert code == 0 and data["values"] == [24, 64, 256]
    assert [r["cache_blocks"] for r in data["runs"]] == [24, 64, 256]
    hits = [r["token_hit_rate"] for r in data["runs"]]
    assert hits[0] <= hits[1] <= hits[2]
    assert (report / "sweep.png").read_bytes().startswith(PNG_MAGIC)
    assert json.loads((report / "sweep.json").read_text())["key"] == "cache-blocks"
    assert (report / "cache-blocks=64" / "ttft.png").exists()


# ------------------------------------------------------------------ determinism, diff


def test_two_replays_of_the_first_120_mooncake_requests_log_identical_bytes_and_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mooncake: Path
):
    a, b = tmp_path / "a.kvlog", tmp_path / "b.kvlog"
    args = [str(mooncake), "--limit", "120", "--json", "--quiet"]

    assert run_cli(capsys, "replay", *args, "--log", str(a))[0] == 0
    assert run_cli(capsys, "replay", *args, "--log", str(b))[0] == 0
    code, out, _ = run_cli(capsys, "verify", str(a), "--quiet")

    assert a.read_bytes() == b.read_bytes()
    assert code == 0 and out.strip().endswith("0 divergences")


def test_first_200_mooncake_requests_replay_at_their_sequential_ideal_hit_rate(
    capsys: pytest.CaptureFixture[str], mooncake: Path
):
    code, out, _ = run_cli(capsys, "replay", str(mooncake), "--limit", "200", "--json", "--quiet")

    m = json.loads(out)
    assert code == 0 and m["requests"] == 200 and m["finished"] == 200
    assert m["token_hit_rate"] == pytest.approx(m["ideal_hit_rate"], abs=0.01)


def test_diff_of_identical_logs_says_so_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    trace, a, b = small_trace(tmp_path), tmp_path / "a.kvlog", tmp_path / "b.kvlog"
    run_cli(capsys, "replay", str(trace), "--quiet", "--log", str(a))
    run_cli(capsys, "replay", str(trace), "--quiet", "--log", str(b))

    code, out, _ = run_cli(capsys, "diff", str(a), str(b))

    assert code == 0 and out.startswith("identical decisions over")


def test_diff_names_the_first_differing_decision_and_the_summary_differences(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    trace, a, b = small_trace(tmp_path), tmp_path / "a.kvlog", tmp_path / "b.kvlog"
    run_cli(capsys, "replay", str(trace), "--quiet", "--log", str(a))
    run_cli(capsys, "replay", str(trace), "--quiet", "--log", str(b), "--cache-blocks", "24")

    code, out, _ = run_cli(capsys, "diff", str(a), str(b), "--json")

    d = json.loads(out)
    assert code == 1 and not d["identical"]
    assert d["first_difference"]["where"] == "decisions"
    assert d["config_changes"]["num_blocks"][1] == 24
    assert d["totals_a"]["hit_tokens"] > d["totals_b"]["hit_tokens"]
    code, text, _ = run_cli(capsys, "diff", str(a), str(b))
    assert "first difference at step" in text and "num_blocks" in text


def test_replay_of_an_event_log_reproduces_its_decisions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    demo, again = tmp_path / "demo.kvlog", tmp_path / "again.kvlog"
    run_cli(capsys, "demo", "--sessions", "4", "--turns", "1", "--quiet", "--log", str(demo))

    code, _, _ = run_cli(capsys, "replay", str(demo), "--quiet", "--log", str(again))

    assert code == 0
    assert run_cli(capsys, "diff", str(demo), str(again))[0] == 0


# ------------------------------------------------------------------------ the demo


def test_demo_goes_through_the_replay_path_and_reports_its_metrics(
    capsys: pytest.CaptureFixture[str],
):
    code, out, _ = run_cli(capsys, "demo", "--sessions", "4", "--turns", "2", "--json", "--quiet")

    m = json.loads(out)
    assert code == 0 and m["requests"] == 8 and m["finished"] == 8
    assert m["token_hit_rate"] > 0 and m["ttft_p99_s"] > 0 and m["workload"] == "chat"


def test_the_hybrid_demo_hits_as_much_as_attention_only_and_its_log_verifies(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    log = tmp_path / "demo.kvlog"
    args = ("demo", "--sessions", "16", "--turns", "3", "--json", "--quiet")
    attention = json.loads(run_cli(capsys, *args)[1])
    code, out, _ = run_cli(capsys, *args, "--hybrid", "--log", str(log))
    hybrid = json.loads(out)
    assert code == 0 and hybrid["token_hit_rate"] >= attention["token_hit_rate"] - 0.01
    kinds = {
        d.kind
        for payload in read_log(str(log)).records
        for d in decode_record(payload).decisions
        if isinstance(d, ev.CheckpointReserved)
    }
    assert {"session_end", "prompt_tail", "branch"} <= kinds
    code, out, _ = run_cli(capsys, "verify", str(log), "--quiet")
    assert code == 0 and out.strip().endswith("0 divergences")


@pytest.mark.parametrize("hybrid", [[], ["--hybrid"]], ids=["attention", "hybrid"])
def test_demo_external_second_engine_loads_the_first_ones_prefixes_and_its_log_verifies(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, hybrid: list[str]
):
    args = ("--sessions", "4", "--turns", "2", "--json", "--quiet", *hybrid)
    plain = json.loads(run_cli(capsys, "demo", *args)[1])
    log = str(tmp_path / "b.kvlog")
    code, out, _ = run_cli(capsys, "demo", "--external", "--log", log, *args)
    m = json.loads(out)
    assert code == 0 and m["finished"] == 8
    assert m["hit_rate_external"] > 0 and m["external_hit_tokens"] > 0
    assert m["prefill_tokens"] < plain["prefill_tokens"] / 2
    assert run_cli(capsys, "verify", log)[0] == 0


# ------------------------------------------------------------------------- failures


def test_unknown_format_exits_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "trace.txt"
    path.write_text("x\n")

    code, out, err = run_cli(capsys, "replay", str(path), "--quiet")

    assert code == 2 and out == ""
    assert err.startswith("kvsched: error:") and "unknown trace format" in err
    with pytest.raises(SystemExit) as exc:
        kvsched.cli.main(["replay", str(path), "--format", "parquet"])
    assert exc.value.code == 2


def test_bad_line_exits_2_naming_file_and_line_unless_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = small_trace(tmp_path)
    lines = path.read_text().splitlines()
    lines.insert(2, '{"timestamp": 5, "input_length": -4, "output_length": 1, "hash_ids": []}')
    path.write_text("\n".join(lines) + "\n")

    code, out, err = run_cli(capsys, "replay", str(path), "--quiet")
    assert code == 2 and out == "" and f"{path}:3: " in err and "Traceback" not in err

    code, out, _ = run_cli(capsys, "replay", str(path), "--quiet", "--json", "--skip-bad-lines")
    m = json.loads(out)
    assert code == 0 and m["bad_lines"] == 1 and m["requests"] == 6


def test_torch_executor_that_cannot_be_imported_exits_2_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    real_import = importlib.import_module

    def no_torch_executor(name: str, package: str | None = None) -> object:
        if name == "kvsched.gpu.torch_executor":
            raise ImportError("No module named 'kvsched.gpu.torch_executor'")
        return real_import(name, package)

    monkeypatch.setattr(kvsched.replay.setup.importlib, "import_module", no_torch_executor)

    code, out, err = run_cli(
        capsys, "replay", str(small_trace(tmp_path)), "--executor", "torch", "--quiet"
    )

    assert code == 2 and out == ""
    assert "--executor torch: the torch executor is not available" in err


def test_bad_cost_model_parameter_exits_2_naming_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    code, _, err = run_cli(capsys, "replay", str(small_trace(tmp_path)), "--cost", "speed=2")

    assert code == 2 and "bad cost-model item 'speed=2'" in err and "prefill_attn_s" in err


# ----------------------------------------------------------------- whole trace (slow)


@pytest.mark.slow
def test_whole_mooncake_trace_replays_within_60_s_at_its_sequential_ideal(
    capsys: pytest.CaptureFixture[str], mooncake: Path
):
    start = time.perf_counter()
    code, out, _ = run_cli(capsys, "replay", str(mooncake), "--json", "--quiet")
    elapsed = time.perf_counter() - start

    m = json.loads(out)
    assert code == 0 and m["requests"] == 3993 and m["rejected"] == 0
    assert abs(m["token_hit_rate"] - 0.651) <= 0.01
    assert m["evictions"] == 0
    assert elapsed <= 60.0


@pytest.mark.slow
def test_whole_mooncake_trace_replays_hybrid_within_60_s_with_half_its_tokens_hit(
    capsys: pytest.CaptureFixture[str], mooncake: Path
):
    start = time.perf_counter()
    code, out, _ = run_cli(capsys, "replay", str(mooncake), "--hybrid", "--json", "--quiet")
    elapsed = time.perf_counter() - start

    m = json.loads(out)
    assert code == 0 and m["requests"] == 3993 and m["finished"] == 3993
    assert m["token_hit_rate"] >= 0.50  # default checkpoint budget (256)
    assert elapsed <= 60.0


# ------------------------------------------------------------- checkpoint policies


def test_policies_run_side_by_side_at_every_budget_and_plot_against_state_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    report = tmp_path / "policies"
    code, out, _ = run_cli(
        capsys, "replay", str(small_trace(tmp_path)), "--hybrid", "--policies", "all",
        "--sweep", "checkpoint-budget=1,16", "--report", str(report), "--json", "--quiet",
    )
    data = json.loads(out)
    runs = data["runs"]
    assert code == 0 and len(runs) == 12
    assert [r["checkpoint_policy"] for r in runs[::2]] == [
        "kvsched", "lmdeploy", "vllm-align", "vllm-kvsched", "sglang", "oracle"
    ]
    assert [r["sweep_value"] for r in runs[:2]] == [1, 16]
    assert runs[1]["state_memory_bytes"] == 16 * runs[1]["state_memory_bytes"] // 16 > 0
    assert (report / "sweep.png").read_bytes().startswith(PNG_MAGIC)
    assert (report / "lmdeploy_checkpoint-budget=16" / "ttft.png").exists()
    # the three requests sharing a prefix: kvsched's branch point serves the third
    by = {(r["checkpoint_policy"], r["sweep_value"]): r["token_hit_rate"] for r in runs}
    assert by[("kvsched", 16)] >= max(by[(p, 16)] for p in ("lmdeploy", "vllm-align", "sglang"))
    assert by[("oracle", 16)] >= by[("kvsched", 16)]  # the upper reference


def test_an_oracle_runs_log_verifies_and_replays_as_a_log_trace_that_verifies_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    first, second = tmp_path / "oracle.kvlog", tmp_path / "again.kvlog"
    options = ("--hybrid", "--checkpoint-policy", "oracle", "--checkpoint-budget", "2", "--quiet")
    trace = str(small_trace(tmp_path))
    assert run_cli(capsys, "replay", trace, *options, "--log", str(first))[0] == 0
    assert run_cli(capsys, "verify", str(first), "--quiet")[0] == 0
    code, _, _ = run_cli(
        capsys, "replay", str(first), "--format", "log", *options, "--log", str(second)
    )
    assert code == 0 and run_cli(capsys, "verify", str(second), "--quiet")[0] == 0


def test_the_oracle_joins_every_comparison_of_policies() -> None:
    assert parse_policies("kvsched,lmdeploy") == ("kvsched", "lmdeploy", "oracle")
    assert parse_policies("oracle,kvsched") == ("oracle", "kvsched")


def test_checkpoint_options_set_the_replayed_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    log = tmp_path / "run.kvlog"
    code, _, _ = run_cli(
        capsys, "replay", str(small_trace(tmp_path)), "--hybrid", "--checkpoint-memory",
        "1GiB", "--checkpoint-placement", "chunk_end,branch,interval", "--checkpoint-eviction",
        "lru",
        "--checkpoint-interval", "1024", "--log", str(log), "--quiet",
    )
    config = read_log(str(log)).header["config"]["checkpoints"]
    assert code == 0 and config["memory"] == 1 << 30
    assert config["placement"] == ["chunk_end", "branch", "interval"]
    assert config["eviction"] == "lru" and config["interval"] == 1024
    assert run_cli(capsys, "verify", str(log), "--quiet")[0] == 0


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("--checkpoint-budget", "-1", "--checkpoint-budget"),
        ("--checkpoint-memory", "lots", "--checkpoint-memory"),
        ("--checkpoint-placement", "chunk_end,everywhere", "--checkpoint-placement"),
        ("--checkpoint-interval", "0", "--checkpoint-interval"),
        ("--policies", "kvsched,marconi", "--policies"),
        ("--sweep", "checkpoint-memory=1GiB,many", "--sweep"),
    ],
)
def test_a_bad_checkpoint_option_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, named: str
):
    try:  # (a range argparse checks exits through SystemExit, the rest returns 2)
        code = kvsched.cli.main(["replay", str(small_trace(tmp_path)), "--hybrid", option, value])
    except SystemExit as exc:
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and named in err
