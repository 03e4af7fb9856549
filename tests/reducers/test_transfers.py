"""TransferTable through its folds: what it refuses about loads."""

from __future__ import annotations

import pytest
from tests.policy.helpers import Harness, tokens

from kvsched.events import types as ev
from kvsched.reducers.errors import ReplayMismatch
from kvsched.statemachines import LoadState, SeqState


def _loading_without_a_row() -> Harness:
    h = Harness(external_kv=True, role="decode")
    h.step([ev.RequestArrived(0, tokens(64, seed=0), 1)])
    h.step([ev.KVLookupAnswered(0, 3)])
    seq = h.state.seqs.seqs[0]
    assert seq.state == SeqState.LOADING_KV and seq.row == -1
    return h


@pytest.mark.parametrize(
    "event", [ev.SequenceAborted(0, "client"), ev.SequencePreempted(0, "blocks")]
)
def test_a_sequence_cannot_leave_while_its_transfer_flies(event: ev.Event) -> None:
    """(The Sequence machine lets a load without a row be aborted or preempted: only once
    its transfer ended, which the transfer table enforces, folding first.)"""
    h = _loading_without_a_row()
    with pytest.raises(ReplayMismatch, match="left while its load is LOADING"):
        h.state.apply(event)


def test_a_load_without_a_row_is_settled_only_into_a_row() -> None:
    h = _loading_without_a_row()
    h.state.apply(ev.KVLoadFinished(0))
    with pytest.raises(ReplayMismatch, match="settled beyond its blocks"):
        h.state.apply(ev.KVLoadSettled(0, 3))  # no row named


def test_the_loads_are_listed_by_sequence_as_a_copy() -> None:
    h = _loading_without_a_row()
    loads = h.state.transfers.loads_by_seq()
    assert [(seq_id, load.state) for seq_id, load in loads] == [(0, LoadState.LOADING)]
    loads.clear()
    assert len(h.state.transfers.loads_by_seq()) == 1
