"""EngineState: the owner order is declared with its reasons and checked at import."""

from __future__ import annotations

import pytest

from kvsched.reducers.state import OWNER_AFTER, OWNER_ORDER, check_owner_order


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
