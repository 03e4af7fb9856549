"""The cluster what-if (``replay/cluster.py``, ``kvsched replay --engines``): one engine is
the plain replay, step for step; routers send shared prefixes where they are cached; each
engine's log verifies; bad options are refused naming them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tests.replay.test_replay_cli import run_cli

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine, PrefixProbe, create_log
from kvsched.events import types as ev
from kvsched.events.log import read_log
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.replay.cluster import ROUTES, Router, run_cluster
from kvsched.replay.driver import run
from kvsched.replay.workload import Turn, Workload, chat_workload

VOCAB = 32000


def _config(**over: object) -> SchedulerConfig:
    fields: dict[str, object] = {
        "model": ModelSpec(vocab_size=VOCAB),
        "block_size": 16,
        "num_blocks": 512,
        "max_batch": 8,
        "max_prefill_tokens": 512,
        **over,
    }
    return SchedulerConfig(**fields)  # type: ignore[arg-type]


def _executors(n: int) -> list[SimulatedExecutor]:
    return [SimulatedExecutor(VOCAB) for _ in range(n)]


def _turn(seq_id: int, prompt: np.ndarray, at: float, max_tokens: int = 4) -> Turn:
    request = ev.RequestArrived(seq_id, prompt, max_tokens, 0.0, eos_token_id=-1)
    return Turn(request, arrival_s=at)


def _shared_prefix_workload(users: int = 8) -> Workload:
    """A 256-token prefix computed first, then ``users`` requests that share it, each with
    its own 40-token question, arriving one every 100 ms once the first has finished."""
    rng = np.random.default_rng(7)
    prefix = rng.integers(1, VOCAB, 256, dtype=np.int32)
    turns = [_turn(0, prefix, 0.0)]
    for i in range(1, users + 1):
        question = rng.integers(1, VOCAB, 40, dtype=np.int32)
        turns.append(_turn(i, np.concatenate([prefix, question]), 10.0 + 0.1 * i))
    return Workload("shared", tuple(turns))


@pytest.mark.parametrize("route", ROUTES)
def test_a_cluster_of_one_engine_logs_the_plain_replays_bytes_under_every_route(
    route: str, tmp_path: Path
):
    workload = chat_workload(sessions=6, turns=3, rate_per_s=40.0, seed=3)  # (closed loop)
    config = _config()
    plain_log, cluster_log = tmp_path / "plain.kvlog", tmp_path / "cluster.kvlog"
    plain = Engine(config, log=create_log(str(plain_log), config))
    run(plain, SimulatedExecutor(VOCAB), workload)
    plain.log.close()  # type: ignore[union-attr]
    engine = Engine(config, log=create_log(str(cluster_log), config))
    got = run_cluster([engine], _executors(1), workload, route)
    engine.log.close()  # type: ignore[union-attr]
    assert cluster_log.read_bytes() == plain_log.read_bytes()
    assert got.metrics["requests"] == len(workload.turns) == got.metrics["finished"]
    assert (got.routed == 0).all()


def test_kv_aware_sends_every_request_sharing_a_cached_prefix_to_the_engine_holding_it():
    workload = _shared_prefix_workload()
    engines = [Engine(_config()) for _ in range(4)]
    got = run_cluster(engines, _executors(4), workload, "kv_aware")
    assert set(got.routed.tolist()) == {int(got.routed[0])}
    blind = run_cluster(
        [Engine(_config()) for _ in range(4)], _executors(4), workload, "round_robin"
    )
    assert len(set(blind.routed.tolist())) == 4
    assert got.metrics["token_hit_rate"] > blind.metrics["token_hit_rate"]
    assert got.metrics["hit_tokens"] == 8 * 256  # every sharer hits the whole prefix


def test_cache_aware_sends_sharers_where_its_own_record_says_the_prefix_went_and_new_ones_apart():
    rng = np.random.default_rng(3)
    workload = _shared_prefix_workload(users=4)
    fresh = [  # prompts sharing nothing, after the sharers
        _turn(10 + i, rng.integers(1, VOCAB, 200, dtype=np.int32), 20.0 + i) for i in range(3)
    ]
    workload = Workload("mixed", workload.turns + tuple(fresh))
    got = run_cluster([Engine(_config()) for _ in range(4)], _executors(4), workload, "cache_aware")
    holder = int(got.routed[0])
    assert got.routed[1:5].tolist() == [holder] * 4  # 256 of 296 tokens matched: > 30 %
    assert set(got.routed[5:].tolist()) == set(range(4)) - {holder}  # the smallest records


def test_kv_aware_spreads_requests_that_share_nothing_by_their_outstanding_work():
    rng = np.random.default_rng(11)
    turns = [_turn(i, rng.integers(1, VOCAB, 200, dtype=np.int32), 0.0, 64) for i in range(8)]
    got = run_cluster(
        [Engine(_config()) for _ in range(4)],
        _executors(4),
        Workload("spread", tuple(turns)),
        "kv_aware",
    )
    assert got.metrics["requests_per_engine"] == [2, 2, 2, 2]
    assert got.metrics["request_imbalance"] == 1.0


def test_least_loaded_counts_a_request_outstanding_until_it_ends():
    rng = np.random.default_rng(5)
    # two long requests first, then six short ones arriving while both still run
    turns = [_turn(i, rng.integers(1, VOCAB, 64, dtype=np.int32), 0.0, 200) for i in range(2)]
    turns += [
        _turn(i, rng.integers(1, VOCAB, 64, dtype=np.int32), 0.01 * i, 2) for i in range(2, 8)
    ]
    got = run_cluster(
        [Engine(_config()) for _ in range(3)],
        _executors(3),
        Workload("load", tuple(turns)),
        "least_loaded",
    )
    assert got.routed[:2].tolist() == [0, 1]
    # the short ones go to the third engine while it is free, never behind a long one
    assert got.metrics["requests_per_engine"][2] >= 4


class _Probed:
    """An engine stand-in answering probes only (what the router reads)."""

    def __init__(self, hit: int, kv: int) -> None:
        self.answer = PrefixProbe(hit, kv)

    def probe_prefix(self, request: ev.RequestArrived) -> PrefixProbe:
        return self.answer


def test_kv_aware_follows_kv_blocks_and_kv_aware_state_the_hybrid_hit_a_request_would_get():
    # engine 0 holds 1,024 tokens of KV but no state under them; engine 1 a state at 512
    engines = [_Probed(hit=0, kv=1024), _Probed(hit=512, kv=512)]
    request = ev.RequestArrived(0, np.ones(1100, dtype=np.int32), 4, 0.0)
    assert Router("kv_aware", engines, 64).choose(request) == 0  # type: ignore[arg-type]
    assert Router("kv_aware_state", engines, 64).choose(request) == 1  # type: ignore[arg-type]


def test_an_engines_probe_reports_its_cached_prefix_without_folding_anything():
    workload = _shared_prefix_workload(users=1)
    engine = Engine(_config())
    run(engine, SimulatedExecutor(VOCAB), Workload("one", workload.turns[:1]))
    before = engine.state.stats.requests_arrived
    probe = engine.probe_prefix(workload.turns[1].request)
    assert probe == PrefixProbe(256, 256)
    assert engine.state.stats.requests_arrived == before
    assert not engine.has_work


def test_session_turns_go_to_the_engine_holding_their_session():
    workload = chat_workload(sessions=8, turns=3, rate_per_s=40.0, seed=1)
    got = run_cluster([Engine(_config()) for _ in range(3)], _executors(3), workload, "round_robin")
    where: dict[int, set[int]] = {}
    for turn in workload.turns:  # (ids 0 .. n-1: ``routed`` is indexed by id)
        where.setdefault(turn.request.session_id, set()).add(int(got.routed[turn.request.seq_id]))
    assert all(len(engines) == 1 for engines in where.values())
    assert len(where) == 8
    assert got.metrics["finished"] == len(workload.turns)


# ------------------------------------------------------------------------------ the CLI


def _trace(tmp_path: Path) -> Path:
    """Ten requests, two prefixes of three blocks each shared by four and three of them."""
    rows = []
    for i in range(10):
        shared = [0, 1, 2] if i % 3 else [10, 11, 12]
        rows.append(
            {
                "timestamp": 300 * i,
                "input_length": 2000,
                "output_length": 4,
                "hash_ids": [*shared, 100 + i],
            }
        )
    path = tmp_path / "shared.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_cluster_replay_writes_one_log_per_engine_and_each_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    trace, log = _trace(tmp_path), tmp_path / "run.kvlog"
    argv = f"--engines 3 --route kv_aware --log {log} --json --quiet".split()
    code, out, _ = run_cli(capsys, "replay", str(trace), *argv)
    assert code == 0
    metrics = json.loads(out)["runs"][0]
    assert sum(metrics["requests_per_engine"]) == 10
    steps = 0
    for k in range(3):
        path = tmp_path / f"run.e{k}.kvlog"
        steps += len(read_log(str(path)).records)
        code, out, _ = run_cli(capsys, "verify", str(path))
        assert code == 0, out
    assert steps > 0


def test_cli_cluster_sweep_compares_routes_per_engine_count_in_a_table_and_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    trace, report = _trace(tmp_path), tmp_path / "report"
    argv = f"--sweep engines=1,3 --route round_robin,kv_aware --report {report} --quiet".split()
    code, out, _ = run_cli(capsys, "replay", str(trace), *argv)
    assert code == 0
    lines = [line.split() for line in out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in lines[:4]] == [
        ("round_robin", "1"),
        ("kv_aware", "1"),
        ("round_robin", "3"),
        ("kv_aware", "3"),
    ]
    runs = json.loads((report / "sweep.json").read_text())["runs"]
    one = [m for m in runs if m["engines"] == 1]
    assert one[0]["token_hit_rate"] == one[1]["token_hit_rate"]  # one engine: no choice
    three = {m["route"]: m for m in runs if m["engines"] == 3}
    assert three["kv_aware"]["token_hit_rate"] > three["round_robin"]["token_hit_rate"]
    assert (report / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "| round_robin | kv_aware |" in (report / "sweep.md").read_text()
    per_engine = (report / "engines.md").read_text()
    assert per_engine.count("| engine | requests |") == 4  # a table per run
    assert (report / "balance.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--route", "kv_aware"], "--route chooses an engine per request: give --engines"),
        (["--engines", "2", "--route", "nearest"], "--route 'nearest': expected one of"),
        (
            ["--engines", "2", "--hybrid", "--policies", "all"],
            "--policies compares checkpoint policies",
        ),
        (["--engines", "2", "--sweep", "cache-blocks=64"], "--sweep takes only engines="),
        (["--sweep", "engines=0"], "each count in [1, 1024]"),
        (
            ["--engines", "2", "--route", "kv_aware,round_robin", "--log", "x.kvlog"],
            "--log records one cluster run",
        ),
        (["--engines", "2", "--jobs", "2"], "--jobs: a cluster's runs share one process"),
    ],
)
def test_cli_cluster_options_that_cannot_work_exit_2_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
):
    code, _, err = run_cli(capsys, "replay", str(_trace(tmp_path)), *argv)
    assert code == 2
    assert message in err
