"""The TTFT order and lmdeploy's prefill-turn policies (policy/ordering.py, policy/turns.py).

Each policy test reproduces the order lmdeploy 0.18 documents for it
(paging/prefill_scheduler.py ``_PrefillReorderer`` / ``_PrefillTurnPolicy``; engine/
inputs_maker.py for the interleaving), with kvsched's sizing: a waiting request is sized by
the tokens left after its tentative prefix match (lmdeploy orders before matching), so a
request whose cached prefix leaves less than a chunk is short, not long.

Config (tests/policy/helpers.py): 16-token blocks, a 64-token budget (one chunk), 8 rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvsched.events import types as ev
from kvsched.policy import PrefillOrder
from kvsched.policy.matching import Matcher
from kvsched.statemachines import TurnState

from .helpers import Harness, admitted, matched, of_type, prefills, request, tokens
from .test_external_loads import Store


def _cache(h: Harness, seq_id: int, prompt: np.ndarray) -> None:
    """Run one request to completion so the full blocks of its prompt become cached."""
    h.step([request(seq_id, prompt, max_tokens=1)])
    h.run_until_idle()


def _order(h: Harness, turn: TurnState) -> list[int]:
    """The order a turn of ``turn`` offers the waiting requests admission now."""
    order = PrefillOrder(h.config, Matcher(h.config))
    return [s.seq_id for s in order.order(h.state, turn)]


def _queue(h: Harness, arrivals: list[ev.RequestArrived]) -> None:
    """Queue the requests without a step (nothing is scheduled)."""
    for arrival in arrivals:
        h.state.apply(arrival)


def _turns(result: object) -> list[tuple[str, bool]]:
    return [(e.turn, e.fallback) for e in of_type(result.decisions, ev.PrefillTurnChosen)]  # type: ignore[attr-defined]


def _mixed_queue(h: Harness) -> None:
    """Waiting: a long prompt (200 tokens), one whose cached prefix (96 of its 116 tokens)
    leaves 20, and two short prompts (50 and 10 tokens), arriving in that order."""
    prefix = tokens(96, seed=5)
    _cache(h, 0, prefix)
    clock = h.clock
    _queue(
        h,
        [
            request(1, 200, arrival_time=clock),
            request(2, np.concatenate([prefix, tokens(20, seed=6)]), arrival_time=clock + 0.1),
            request(3, 50, arrival_time=clock + 0.2),
            request(4, 10, arrival_time=clock + 0.3),
        ],
    )


# ------------------------------------------------------------------------------ sizing


def test_a_follow_up_turn_is_sized_by_the_tokens_left_after_its_cached_history():
    # The case: an 8-token follow-up of a 202-token session (192 tokens cached in
    # full blocks) has 18 tokens to compute; every fresh prompt has 40.
    h = Harness(order="ttft", max_prefill_tokens=256, num_blocks=128)
    h.step([request(0, 150, max_tokens=52, session_id=1)])
    h.run_until_idle()
    assert len(h.state.sessions.history[1].tokens) == 202
    clock = h.clock
    fresh = [request(i, 40, arrival_time=clock) for i in range(1, 7)]
    follow_up = request(7, 8, session_id=1, arrival_time=clock + 0.01)
    result = h.step([*fresh, follow_up])
    assert matched(result)[7].num_tokens == 192
    # 18 + 5 x 40 = 218 fit the 256-token budget; the sixth fresh prompt waits.
    assert admitted(result) == [7, 1, 2, 3, 4, 5]


# ------------------------------------------------------------------------ turn policies


def test_a_short_only_turn_admits_short_prompts_by_size_and_skips_long_ones():
    h = Harness(order="ttft", prefill_turns="short_only")
    _mixed_queue(h)
    assert _order(h, TurnState.SHORT_ONLY) == [4, 2, 3, 1]
    first = h.step()
    # 10 + 20 (after its 96 cached tokens); 50 more would pass the budget; the long prompt
    # is gated (lmdeploy: "the non-final long gate SKIPs" it).
    assert prefills(first) == [(4, 0, 10), (2, 96, 116)]
    assert admitted(h.step()) == [3]
    # Only long work is left: a long-first turn, its first chunk.
    last = h.step()
    assert _turns(last) == [("long_first", False)] and prefills(last) == [(1, 0, 64)]


def test_a_long_first_turn_offers_one_long_prompt_then_short_ones_by_size_then_the_rest():
    h = Harness(order="ttft", prefill_turns="long_first", num_blocks=128)
    prefix = tokens(192, seed=7)
    _cache(h, 0, prefix)
    clock = h.clock
    _queue(
        h,
        [
            request(1, 300, arrival_time=clock),  # 5 chunks
            request(2, np.concatenate([prefix, tokens(150, seed=8)]), arrival_time=clock + 0.1),
            request(3, 30, arrival_time=clock + 0.2),
            request(4, 10, arrival_time=clock + 0.3),
            request(5, 260, arrival_time=clock + 0.4),  # 5 chunks, arrived later
        ],
    )
    # Request 2 (342 tokens, 6 chunks) has 150 left after its 192 cached tokens: 3 chunks,
    # the fewest of the long lane.
    assert _order(h, TurnState.LONG_FIRST) == [2, 4, 3, 1, 5]
    assert prefills(h.step()) == [(2, 192, 256)]  # the long chunk takes the whole budget


def test_the_fifo_long_lane_offers_long_prompts_in_arrival_order():
    h = Harness(order="ttft", prefill_turns="long_first", long_order="fifo")
    _queue(
        h,
        [
            request(1, 300, arrival_time=0.0),
            request(2, 100, arrival_time=0.1),
            request(3, 10, arrival_time=0.2),
            request(4, 130, arrival_time=0.3),
        ],
    )
    assert _order(h, TurnState.LONG_FIRST) == [1, 3, 2, 4]
    size = Harness(order="ttft", prefill_turns="long_first")  # fewest chunks first
    _queue(size, [request(i, n, arrival_time=t) for i, n, t in [(1, 300, 0), (2, 100, 0.1)]])
    assert _order(size, TurnState.LONG_FIRST) == [2, 1]


def test_a_long_first_if_final_turn_offers_a_long_prompt_first_but_runs_only_final_prefills():
    h = Harness(order="ttft", prefill_turns="long_first_if_final")
    _mixed_queue(h)
    assert _order(h, TurnState.LONG_FIRST_IF_FINAL) == [1, 4, 2, 3]
    # The long prompt is offered first and skipped (its match leaves 200 tokens: not
    # final); the final prefills fill the budget by size.
    assert prefills(h.step()) == [(4, 0, 10), (2, 96, 116)]
    long_first = Harness(order="ttft", prefill_turns="long_first")
    _mixed_queue(long_first)
    assert prefills(long_first.step()) == [(1, 0, 64)]


def test_a_standard_turn_keeps_the_orders_own_order_and_allows_long_prefills():
    h = Harness(order="ttft", prefill_turns="standard")
    _mixed_queue(h)
    assert _order(h, TurnState.STANDARD) == [4, 2, 3, 1]
    result = h.step()
    assert prefills(result) == [(4, 0, 10), (2, 96, 116)] and not _turns(result)
    assert admitted(h.step()) == [3]
    assert admitted(h.step()) == [1]
    for order in ("fcfs", "priority"):  # never leave the standard turn: arrival order here
        with pytest.raises(ValueError, match=r"turns\.policy is used only by order 'ttft'"):
            Harness(order=order, prefill_turns="short_only")  # (it would be ignored)
        other = Harness(order=order)
        _mixed_queue(other)
        first = other.step()
        assert admitted(first) == [1] and not _turns(first)
        assert other.state.turns.turn == TurnState.STANDARD


# ----------------------------------------------------------------------- interleaving


@pytest.mark.parametrize("quota", [2, 3])
def test_interleaving_runs_a_long_chunk_after_every_quota_of_short_turns(quota: int):
    kw = {"short_turns_per_long": quota} if quota != 3 else {}  # 3: the default
    h = Harness(order="ttft", num_blocks=256, max_batch=16, **kw)
    long_steps = []  # the steps that ran a chunk of the long prompt
    for step in range(12):
        arrivals = [request(100 + step, 10, max_tokens=1, arrival_time=h.clock)]
        if step == 0:
            arrivals.insert(0, request(0, 640, max_tokens=1, arrival_time=h.clock))
        ran = {s for s, _, _ in prefills(h.step(arrivals))}
        if 0 in ran:
            long_steps.append(step)
        # A long turn's chunk fills the budget; a short turn admits the short prompts.
        assert ran == {0} or (0 not in ran and 100 + step in ran)
    period = quota + 1
    assert long_steps == list(range(quota, 12, period))
    assert h.state.turns.short_turns < quota


def test_without_long_work_interleaving_takes_standard_turns_by_size():
    h = Harness(order="ttft")
    result = h.step([request(0, 40, arrival_time=0.0), request(1, 10, arrival_time=0.1)])
    assert admitted(result) == [1, 0] and h.state.turns.turn == TurnState.STANDARD


def test_a_short_turn_that_schedules_nothing_falls_back_to_the_long_chunk_in_the_same_step():
    # One row: the long prompt's row is taken, the short prompt cannot be admitted, and the
    # long chunk must not stall behind it.
    h = Harness(order="ttft", max_batch=1)
    assert prefills(h.step([request(0, 300, max_tokens=1)])) == [(0, 0, 64)]
    result = h.step([request(1, 10, max_tokens=1, arrival_time=h.clock)])
    assert _turns(result) == [("short_only", False), ("long_first", True)]
    assert prefills(result) == [(0, 64, 128)]


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("prefill_turns", "long_last"),
        ("long_order", "lifo"),
        ("ttft_size", "prompt"),
        ("short_turns_per_long", 0),
        ("short_turns_per_long", True),
    ],
)
def test_a_bad_prefill_turn_option_raises_a_value_error_naming_it(option: str, value: object):
    with pytest.raises(ValueError, match=_NAMES.get(option, option)):
        Harness(order="ttft", **{option: value})


_NAMES = {  # the names of the settings in the config (and its error messages)
    "prefill_turns": "turns.policy",
    "short_turns_per_long": "turns.short_per_long",
    "long_order": "turns.long_order",
}


class _HitOf:
    """A matcher whose tentative match is always ``num_tokens`` long."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def find_prefix(self, state: object, seq: object) -> _HitOf:
        return self


def test_a_long_request_is_sized_by_its_canonical_chunks_from_a_match_off_the_chunk_grid():
    """150 tokens, 64-token chunks, a 48-token hit: the canonical chunks left are [48, 64),
    [64, 128), [128, 150): three, not the two 102 tokens would fill."""
    order = PrefillOrder(Harness(order="ttft").config, _HitOf(48))  # type: ignore[arg-type]
    seq = SimpleNamespace(n_tokens=150)
    (sized,) = order.sizes(None, [seq])  # type: ignore[arg-type, list-item]
    assert (sized.left, sized.chunks, sized.long) == (102, 3, True)
    (on_grid,) = PrefillOrder(order.config, _HitOf(64)).sizes(None, [seq])  # type: ignore[arg-type, list-item]
    assert (on_grid.left, on_grid.chunks) == (86, 2)


def test_under_priority_ready_loads_take_the_free_row_in_priority_order() -> None:
    """Two loads end while the only row runs; when it frees, the higher priority (the later
    arrival) settles into it first."""
    h = Store(max_batch=1, order="priority")
    h.run(request(0, 16, max_tokens=6))  # runs in the only row
    h.run(ev.RequestArrived(1, tokens(64, seed=1), 1, priority=0))
    h.run(ev.RequestArrived(2, tokens(64, seed=2), 1, priority=5))
    h.answer({1: 3, 2: 3})
    h.finish_loads()
    settled: list[int] = []
    for _ in range(40):
        settled += [d.seq_id for d in h.run() if isinstance(d, ev.KVLoadSettled)]
    assert settled == [2, 1], "ready loads took the row in arrival order, not priority"
