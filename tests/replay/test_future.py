"""The recorded future of a trace (replay/future.py): where later hits end, who uses them."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.config import CHECKPOINT_POLICIES, ModelSpec, SchedulerConfig
from kvsched.events import types as ev
from kvsched.headers import FLAT_OF
from kvsched.replay.future import future_for, hit_ends, reuse_pairs, with_future
from kvsched.replay.setup import SetupError
from kvsched.replay.workload import Turn, Workload, chat_workload


def oracle_config(**kw: object) -> SchedulerConfig:
    """The oracle's rules on a small model (16-token blocks); flat field names in ``kw``."""
    base = {"model": ModelSpec(vocab_size=1000, max_context=1024), "block_size": 16}
    fields = {"hybrid": True, **base, **kw, **preset_fields("oracle")}
    return SchedulerConfig.from_dict(fields)


def preset_fields(name: str) -> dict[str, object]:
    return {FLAT_OF["checkpoints", k]: v for k, v in CHECKPOINT_POLICIES[name].items()}


def chains(*paths: str) -> list[list[bytes]]:
    """A chain per path: block k's digest names the path's first k + 1 letters."""
    return [[p[: k + 1].encode() for k in range(len(p))] for p in paths]


def test_a_hit_ends_where_the_longest_earlier_prefix_ends_capped_at_the_prompt_tail() -> None:
    got = hit_ends(chains("abcd", "abxy", "abcz", "abcd"), [4, 4, 4, 2])
    assert got == [0, 2, 3, 2]  # the last would reach 4 blocks; its tail allows 2


def test_each_request_learns_the_first_later_request_whose_hit_ends_on_its_prefix() -> None:
    paths = chains("abcd", "abxy", "abcz", "abq", "abcw")
    pairs = reuse_pairs([0, 1, 2, 3, 4], paths, [4, 4, 4, 3, 4], 16)
    # hits end: 1 at "ab" (2 blocks), 2 at "abc" (3), 3 at "ab" (2), 4 at "abc" (3)
    assert pairs[0] == ((32, 1), (48, 2))
    assert pairs[1] == ((32, 3),)  # "ab" next used by 3; "abx" by nobody
    assert pairs[2] == ((32, 3), (48, 4))
    assert pairs[3] == ()
    assert pairs[4] == ()


def test_the_driver_records_the_future_only_under_the_oracle_and_strips_it_otherwise() -> None:
    rng = np.random.default_rng(0)
    shared = rng.integers(1, 1000, 40, dtype=np.int32)
    turns = tuple(
        Turn(
            ev.RequestArrived(i, np.concatenate([shared, rng.integers(1, 1000, 20, np.int32)]), 2),
            arrival_s=float(i),
        )
        for i in range(3)
    )
    w = with_future(Workload("t", turns), oracle_config())
    assert [t.request.reuse for t in w.turns] == [((32, 1),), ((32, 2),), ()]
    plain = SchedulerConfig(hybrid=True)
    assert all(not t.request.reuse for t in future_for(plain, w).turns)
    assert future_for(plain, Workload("t", turns)).turns is turns


def test_the_oracle_refuses_a_workload_whose_future_depends_on_the_run() -> None:
    with pytest.raises(SetupError, match="'oracle' needs a trace's future: a session turn"):
        with_future(chat_workload(sessions=2, turns=2), oracle_config())


def test_the_oracle_refuses_ids_that_are_not_in_arrival_order() -> None:
    turns = (
        Turn(ev.RequestArrived(1, np.arange(1, 40, dtype=np.int32), 2), arrival_s=0.0),
        Turn(ev.RequestArrived(0, np.arange(1, 40, dtype=np.int32), 2), arrival_s=1.0),
    )
    with pytest.raises(SetupError, match="arrival order"):
        with_future(Workload("t", turns), oracle_config())


def test_the_oracle_preset_is_one_of_the_named_policies() -> None:
    assert CHECKPOINT_POLICIES["oracle"]["placement"] == ("oracle",)


def test_an_oracle_runs_log_verifies_and_replays_as_a_trace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvsched.engine import Engine, create_log
    from kvsched.gpu.sim import SimulatedExecutor
    from kvsched.replay.runs import replay
    from kvsched.replay.traces import read_log_trace
    from kvsched.replay.verify import verify_log

    rng = np.random.default_rng(5)
    docs = [rng.integers(1, 1000, 48, dtype=np.int32) for _ in range(3)]
    turns = tuple(
        Turn(
            ev.RequestArrived(
                i, np.concatenate([docs[i % 3][: 16 * (1 + i % 3)], rng.integers(1, 1000, 9)]), 2
            ),
            arrival_s=0.01 * i,
        )
        for i in range(12)
    )
    cfg = oracle_config(checkpoint_budget=2, num_blocks=256)
    path = str(tmp_path / "oracle.kvlog")
    log = create_log(path, cfg)
    engine = Engine(cfg, log=log, check_invariants=True)
    result = replay(engine, SimulatedExecutor(1000), Workload("t", turns))
    log.close()
    assert result.metrics["token_hit_rate"] > 0
    verified = verify_log(path)
    assert verified.divergence is None and verified.steps > 0
    again = read_log_trace(path).workload
    assert any(t.request.reuse for t in again.turns)  # the log holds the future it was given
    plain = Engine(SchedulerConfig(model=cfg.model, block_size=16, hybrid=True, num_blocks=256))
    assert replay(plain, SimulatedExecutor(1000), again).metrics["requests"] == 12
