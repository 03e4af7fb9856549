"""The known / speculative split of a trace's ideal hits (replay/bound.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.events.types import RequestArrived
from kvsched.replay.bound import main, reuse_bound, trace_prompts
from kvsched.replay.shapes import token_ideal
from kvsched.replay.traces import Trace, TraceError, TraceInfo
from kvsched.replay.workload import Turn, Workload


def prompts(*rows: list[int]) -> list[np.ndarray]:
    return [np.array(r, dtype=np.int32) for r in rows]


FOUR = prompts(
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 4, 9, 9, 7],  # first share of (1 2 3 4), made by request 0: speculative
    [1, 2, 3, 4, 8, 8, 7],  # the same hit end again: known
    [1, 2, 3, 4, 9, 9, 5, 5, 1],  # known to (1 2 3 4), then speculative (9 9) made by 1
)


def test_hits_at_an_earlier_hit_end_are_known_and_the_rest_is_speculative() -> None:
    bound = reuse_bound(FOUR, block_size=2, windows=(1, 2))
    assert bound.requests == 4
    assert bound.known == pytest.approx(8 / 30)
    assert bound.speculative == pytest.approx(6 / 30)
    assert bound.ideal == pytest.approx(14 / 30)
    assert [w for w, _ in bound.within] == [1, 2]
    assert [v for _, v in bound.within] == pytest.approx([4 / 30, 6 / 30])
    assert bound.producers == 2


def test_a_branch_point_is_alive_from_its_first_sharer_to_its_last_use() -> None:
    bound = reuse_bound(FOUR, block_size=2)
    assert bound.live_peak == 1
    assert bound.live_mean == pytest.approx(1 / 4)


def test_the_split_adds_up_to_the_sequential_ideal() -> None:
    rng = np.random.default_rng(7)
    stems = [rng.integers(1, 50, 40, dtype=np.int32) for _ in range(5)]
    rows = [
        np.concatenate([stems[rng.integers(5)][: rng.integers(1, 40)], rng.integers(1, 50, 9)])
        for _ in range(200)
    ]
    rows = [r.astype(np.int32) for r in rows]
    bound = reuse_bound(rows, block_size=4)
    assert bound.ideal == pytest.approx(token_ideal(rows, 4))
    assert bound.known + bound.speculative == pytest.approx(bound.ideal)
    assert bound.within[-1][1] <= bound.speculative + 1e-12


def test_a_block_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="block size"):
        reuse_bound(FOUR, block_size=0)


def turn(seq_id: int, arrival_s: float, follows: int = -1) -> Turn:
    prompt = np.full(8, seq_id, dtype=np.int32)
    return Turn(RequestArrived(seq_id, prompt, 4), arrival_s=arrival_s, follows=follows)


def trace(*turns: Turn) -> Trace:
    return Trace(Workload("t", turns), TraceInfo("t.jsonl", "mooncake", len(turns), len(turns)))


def test_prompts_come_in_arrival_order() -> None:
    out = trace_prompts(trace(turn(1, 2.0), turn(2, 1.0), turn(3, 1.0)))
    assert [int(p[0]) for p in out] == [2, 3, 1]


def test_closed_loop_turns_are_refused_with_the_trace_named() -> None:
    with pytest.raises(TraceError, match=r"t\.jsonl: closed-loop"):
        trace_prompts(trace(turn(1, 0.0), turn(2, 0.0, follows=1)))


def test_the_command_prints_the_split_of_a_generated_shape(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["gen:chat-branching", "--block-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "ideal hit rate" in out and "speculative" in out and "alive at once" in out


def test_the_command_names_a_missing_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["/nonexistent/trace.jsonl"]) == 2
    assert capsys.readouterr().err.startswith("kvsched: error: ")
