"""policy/transfers.py: when a sequence is looked up in the external store, what a load
reserves, and which of a row's cached blocks are saved to the store (each once)."""

from __future__ import annotations

from tests.policy.helpers import Harness, of_type, tokens

from kvsched.events import types as ev

BS = 16


def test_a_new_sequence_is_looked_up_first_and_admitted_only_after_the_answer() -> None:
    h = Harness(external_kv=True, role="decode")
    first = h.step([ev.RequestArrived(0, tokens(64, seed=0), 1)]).decisions
    assert [e.seq_id for e in of_type(first, ev.KVLookupStarted)] == [0]
    assert not of_type(first, ev.SequenceAdmitted)  # it waits for the store
    answered = h.step([ev.KVLookupAnswered(0, 0)]).decisions  # a miss: computed locally
    assert [e.seq_id for e in of_type(answered, ev.SequenceAdmitted)] == [0]


def test_a_load_without_a_row_reserves_the_prompt_blocks_it_still_lacks() -> None:
    h = Harness(external_kv=True, role="decode")
    h.step([ev.RequestArrived(0, tokens(64, seed=0), 1)])
    h.step([ev.KVLookupAnswered(0, 3)])  # 3 of its 4 prompt blocks are in the store
    held = len(h.state.seqs.block_table(h.state.seq(0)))
    assert held == 3
    assert h.engine.policy.transfers.soft_reserved(h.state) == 4 - held


def test_a_rows_newly_cached_blocks_are_saved_to_the_store_once() -> None:
    h = Harness(external_kv=True, role="both")
    h.step([ev.RequestArrived(0, tokens(40, seed=1), 20)])
    h.step([ev.KVLookupAnswered(0, 0)])
    computed = h.step().decisions  # the prompt ran: its 2 full blocks are cached, then saved
    saves = of_type(computed, ev.KVSaveStarted)
    assert [(s.seq_id, s.first_block, len(s.blocks)) for s in saves] == [(0, 0, 2)]
    later = [e for _ in range(10) for e in of_type(h.step().decisions, ev.KVSaveStarted)]
    # decoding to position 48 filled block 2: only it is saved
    assert [(s.first_block, len(s.blocks)) for s in later] == [(2, 1)]
