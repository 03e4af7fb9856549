"""Setting up a replay without the command line: the scheduler config of a trace (Mooncake
defaults vs a kvsched log's header config), the unbounded cache, sweep specs and option checks
that fail as ``SetupError`` naming the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvsched.replay.setup
from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.gpu.sim import CostModel, SimulatedExecutor
from kvsched.replay.demo import run_demo
from kvsched.replay.runs import replay_trace
from kvsched.replay.setup import (
    SWEEP_KEYS,
    TRACE_VOCAB,
    SetupError,
    load_trace_replay,
    make_executor,
    parse_sweep,
    sweep_config,
    trace_config,
    unbounded_blocks,
)
from kvsched.replay.traces import read_trace


def mooncake(tmp_path: Path, longest: int = 1100) -> Path:
    """Three requests; the first two share a 1,024-token prefix (Mooncake blocks of 512)."""
    first = list(range(-(-longest // 512)))
    rows = [
        {"timestamp": 0, "input_length": longest, "output_length": 8, "hash_ids": first},
        {
            "timestamp": 400,
            "input_length": 1300,
            "output_length": 5,
            "hash_ids": [0, 1, len(first)],
        },
        {"timestamp": 800, "input_length": 200, "output_length": 9, "hash_ids": [len(first) + 1]},
    ]
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def demo_log(tmp_path: Path) -> Path:
    """A kvsched event log of a small hybrid run with non-default limits."""
    path = tmp_path / "demo.kvlog"
    run_demo(sessions=2, turns=1, cache_blocks=300, max_batch=7, hybrid=True, log=str(path))
    return path


# ------------------------------------------------------------------ trace config


def test_a_mooncake_trace_gets_the_trace_vocabulary_and_a_cache_that_never_evicts(
    tmp_path: Path,
):
    trace = read_trace(mooncake(tmp_path))

    config = trace_config(trace)

    assert config.model.vocab_size == TRACE_VOCAB
    assert config.block_size == 64 and config.max_batch == SchedulerConfig().max_batch
    assert config.num_blocks == unbounded_blocks(trace.info, trace.info.requests, 64)


def test_a_trace_longer_than_the_default_context_doubles_the_context_until_it_fits(
    tmp_path: Path,
):
    default = ModelSpec().max_context
    trace = read_trace(mooncake(tmp_path, longest=default + 100))

    config = trace_config(trace)

    assert config.model.max_context == 2 * default


def test_a_kvsched_log_is_replayed_with_the_config_its_header_records(tmp_path: Path):
    trace = read_trace(demo_log(tmp_path))

    config = trace_config(trace)

    assert config.model.vocab_size == ModelSpec().vocab_size  # the log's, not TRACE_VOCAB
    assert config.max_batch == 7 and config.hybrid
    assert config.num_blocks == unbounded_blocks(trace.info, trace.info.requests, 64)


def test_given_options_override_the_config_of_a_log_header(tmp_path: Path):
    trace = read_trace(demo_log(tmp_path))

    config = trace_config(
        trace, block_size=32, cache_blocks=50, max_batch=3, max_prefill_tokens=1024, order="ttft"
    )

    assert (config.block_size, config.num_blocks, config.max_batch) == (32, 50, 3)
    assert config.max_prefill_tokens == 1024 and config.order == "ttft" and config.hybrid


def test_an_unbounded_cache_holds_every_request_in_blocks_of_its_own(tmp_path: Path):
    setup = load_trace_replay(str(mooncake(tmp_path)))
    info = setup.trace.info

    blocks = unbounded_blocks(info, info.requests, 64)
    result = replay_trace(setup, trace_config(setup.trace))

    assert blocks == info.total_tokens // 64 + 2 * info.requests + 2
    assert result.metrics["evictions"] == 0 and result.metrics["rejected"] == 0


def test_a_configuration_the_scheduler_refuses_is_a_setup_error(tmp_path: Path):
    trace = read_trace(mooncake(tmp_path))

    with pytest.raises(SetupError, match="bad configuration: block_size must be an integer"):
        trace_config(trace, block_size=1 << 17)


# ------------------------------------------------------------------------ sweeps


def test_a_sweep_spec_is_its_key_and_integer_values():
    assert parse_sweep("cache-blocks=24, 1_000") == ("cache-blocks", [24, 1000])
    assert set(SWEEP_KEYS) == {
        "cache-blocks", "block-size", "max-batch", "max-prefill-tokens", "checkpoint-budget",
        "checkpoint-memory",
    }
    assert parse_sweep("checkpoint-memory=1GiB,512MiB") == (
        "checkpoint-memory", [1 << 30, 512 << 20]
    )


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("foo=1", "expected KEY=V1,V2,... with KEY one of cache-blocks, block-size"),
        ("max-batch", "expected KEY=V1,V2,..."),
        ("max-batch=a", "values must be integers"),
        ("max-batch=0,4", "give one or more positive values"),
        ("max-batch=,", "give one or more positive values"),
    ],
)
def test_a_bad_sweep_spec_is_a_setup_error_naming_the_option_and_the_spec(spec: str, reason: str):
    with pytest.raises(SetupError) as err:
        parse_sweep(spec)

    assert str(err.value).startswith(f"--sweep {spec!r}: ") and reason in str(err.value)


def test_a_sweep_point_the_scheduler_refuses_names_the_point():
    assert sweep_config(SchedulerConfig(), "max-batch", 3).max_batch == 3
    with pytest.raises(SetupError, match="--sweep block-size=131072: block_size must be an"):
        sweep_config(SchedulerConfig(), "block-size", 1 << 17)


# ---------------------------------------------------------------- option checks


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cost": "speed=2"}, "bad cost-model item 'speed=2'"),
        ({"sweep": "max-batch=2", "log": "x.kvlog"}, "--log records one run"),
        ({"speedup": 0.0}, "--speedup must be positive, got 0.0"),
    ],
)
def test_a_bad_replay_option_is_a_setup_error_naming_it(
    tmp_path: Path, options: dict[str, object], message: str
):
    with pytest.raises(SetupError, match=message.replace("(", r"\(")):
        load_trace_replay(str(mooncake(tmp_path)), **options)  # type: ignore[arg-type]


def test_a_torch_replay_without_the_torch_executor_is_a_setup_error_saying_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    def no_torch(name: str, package: str | None = None) -> object:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(kvsched.replay.setup.importlib, "import_module", no_torch)

    with pytest.raises(SetupError, match="--executor torch: the torch executor is not available"):
        load_trace_replay(str(mooncake(tmp_path)), executor="torch", model="m")


def test_a_replay_setup_reports_the_trace_and_options_its_runs_add_to_their_metrics(
    tmp_path: Path,
):
    setup = load_trace_replay(str(mooncake(tmp_path)), speedup=2.0, cost="overhead_s=0.001")

    extra = setup.extra()

    assert extra["format"] == "mooncake" and extra["trace_lines"] == 3
    assert extra["speedup"] == 2.0 and extra["cost_model"]["overhead_s"] == 0.001
    assert setup.trace.workload.turns[1].arrival_s == pytest.approx(0.2)


def test_the_sim_executor_uses_the_config_vocabulary_and_a_setup_error_is_a_value_error():
    config = SchedulerConfig(model=ModelSpec(vocab_size=1000))

    executor = make_executor("sim", config, CostModel())

    assert isinstance(executor, SimulatedExecutor) and executor.vocab_size == 1000
    assert issubclass(SetupError, ValueError)


def test_a_budget_sweep_takes_unbounded_and_keys_may_be_swept_side_by_side_once_each():
    from kvsched.replay.setup import parse_sweeps
    from kvsched.replay.sweep_table import UNBOUNDED_BUDGET

    assert parse_sweep("checkpoint-budget=64,unbounded") == (
        "checkpoint-budget",
        [64, UNBOUNDED_BUDGET],
    )
    assert parse_sweeps(["checkpoint-budget=64", "checkpoint-memory=1GiB"]) == (
        ("checkpoint-budget", [64]),
        ("checkpoint-memory", [1 << 30]),
    )
    with pytest.raises(SetupError, match="--sweep: each key once"):
        parse_sweeps(["max-batch=2", "max-batch=4"])
    with pytest.raises(SetupError, match="values must be integers"):
        parse_sweep("cache-blocks=unbounded")


def test_a_memory_point_and_a_budget_point_each_reset_the_other_checkpoint_limit():
    hybrid = SchedulerConfig(hybrid=True)
    memory = sweep_config(hybrid, "checkpoint-memory", 1 << 30)
    assert memory.checkpoints.memory == 1 << 30
    budget = sweep_config(memory, "checkpoint-budget", 64)
    assert budget.checkpoints.memory == 0 and budget.num_checkpoint_slots == 64
