"""reducers/state.py: ``EngineState``, the owners behind one ``apply`` and its queries; the
owner order is declared with its reasons and checked at import."""

from __future__ import annotations

import pytest
from tests.policy.helpers import Harness, config, request

from kvsched.events import types as ev
from kvsched.reducers.inputs import InputError, validate_inputs
from kvsched.reducers.state import (
    OWNER_AFTER,
    OWNER_ORDER,
    EngineState,
    check_owner_order,
    idle_owners,
)


def test_the_declared_owner_order_satisfies_every_constraint() -> None:
    check_owner_order(OWNER_ORDER, OWNER_AFTER)


def test_an_owner_order_that_puts_holdings_before_the_sequences_is_refused_with_the_reason():
    order = list(OWNER_ORDER)
    order.remove("holdings")
    order.insert(order.index("seqs"), "holdings")
    with pytest.raises(TypeError, match=r"holdings must fold after seqs \(a rowless load"):
        check_owner_order(order, OWNER_AFTER)


def test_an_owner_order_missing_an_owner_is_refused() -> None:
    with pytest.raises(TypeError, match="does not name each owner"):
        check_owner_order([n for n in OWNER_ORDER if n != "turns"], OWNER_AFTER)


def test_the_sequences_must_fold_after_the_sessions_that_keep_their_history() -> None:
    order = list(OWNER_ORDER)
    order.remove("sessions")
    order.append("sessions")
    with pytest.raises(TypeError, match="seqs must fold after sessions"):
        check_owner_order(order, OWNER_AFTER)


def test_an_empty_engine_has_no_work_and_an_arrival_gives_it_some():
    h = Harness()
    assert not h.state.has_work
    h.step([request(1, 20)])
    assert h.state.has_work and h.state.seq(1).seq_id == 1


def test_two_engines_fed_the_same_inputs_hold_the_same_state():
    a, b = Harness(), Harness()
    for h in (a, b):
        h.step([request(1, 40), request(2, 25)])
        h.step()
    assert a.state.snapshot() == b.state.snapshot()


def test_a_decision_given_as_an_input_is_refused_before_anything_changes():
    state = EngineState(config())
    before = state.snapshot()
    with pytest.raises(InputError):
        validate_inputs(state, [request(1, 20), ev.CacheCleared()])
    assert state.snapshot() == before


def test_every_held_block_is_listed_by_its_holder():
    h = Harness()
    h.step([request(1, 40)])
    held = sorted(int(b) for blocks in h.state.holders() for b in blocks)
    assert len(held) == 3 and len(set(held)) == 3


def _visited(state: EngineState) -> set[str]:
    """The owners whose folds ``apply`` visits."""
    owners = {id(getattr(state, name)): name for name in OWNER_ORDER}
    return {owners[id(h.__self__)] for hs in state._routes.values() for h in hs}  # type: ignore[attr-defined]


def test_an_attention_engine_without_external_kv_visits_only_the_owners_it_needs():
    state = EngineState(config())
    idle = {"transfers", "holdings", "ckpts", "turns", "future"}
    assert idle_owners(state.config) == idle
    assert _visited(state) == set(OWNER_ORDER) - idle


def test_a_hybrid_engine_with_soft_external_loads_under_the_oracle_visits_every_owner():
    oracle = {"checkpoint_placement": ("oracle",), "checkpoint_eviction": "oracle"}
    state = EngineState(
        config(hybrid=True, external_kv=True, load_admission="soft", order="ttft", **oracle)
    )
    assert idle_owners(state.config) == frozenset()
    assert _visited(state) == set(OWNER_ORDER)
