"""External loads under soft reservations (``load_admission="soft"``, lmdeploy's): a load takes
no batch row and holds only the blocks it loads into; the rest of its prompt is reserved
softly, so a new load is admitted only if its prefill fits beside every incomplete load's
reservation, while ordinary admissions may borrow reserved blocks; a load that ended is
settled into a row before anything else waiting. Logs before schema 4 keep the old rule (a
row and every prompt block at once)."""

from __future__ import annotations

import pytest
from tests.policy.helpers import Harness, of_type, tokens

from kvsched.config import SchedulerConfig
from kvsched.engine import StepResult
from kvsched.events import types as ev
from kvsched.policy.transfers import Transfers
from kvsched.statemachines import LoadState, SeqState

BS = 16


class Store(Harness):
    """An engine and a simulated executor, with an external store answered by hand."""

    def __init__(self, **overrides: object) -> None:
        base: dict[str, object] = {"external_kv": True, "role": "decode"}  # (loads, no saves)
        super().__init__(**{**base, **overrides})

    def run(self, *inputs: ev.Event) -> list[ev.Event]:
        return list(self.step(inputs).decisions)

    def answer(self, store_blocks: dict[int, int]) -> list[ev.Event]:
        """One step answering the pending lookups: ``store_blocks[seq]`` blocks of the store
        (a miss for any other)."""
        answers = [
            ev.KVLookupAnswered(s, store_blocks.get(s, 0))
            for s, load in sorted(self.state.transfers.loads.items())
            if load.state == LoadState.LOOKUP_PENDING
        ]
        return self.run(*answers)

    def finish_loads(self) -> list[ev.Event]:
        return self.run(*[ev.KVLoadFinished(s) for s in self.state.transfers.in_flight_loads()])

    def held(self, seq_id: int) -> int:
        seq = self.state.seqs.seqs[seq_id]
        return len(self.state.seqs.block_table(seq))

    def drive(self, steps: int = 300) -> None:
        """Run, the store finishing every load as soon as it starts, until idle."""
        for _ in range(steps):
            if not self.engine.has_work and not self.outcome:
                return
            self.finish_loads()
        raise AssertionError(f"not idle: waiting {sorted(self.state.seqs.waiting)}")


def request(seq_id: int, n: int, max_tokens: int = 1, **kw: object) -> ev.RequestArrived:
    return ev.RequestArrived(seq_id, tokens(n, seed=seq_id), max_tokens, **kw)


def loads_admitted(decisions: list[ev.Event]) -> list[int]:
    return [d.seq_id for d in of_type(decisions, ev.KVLoadAdmitted)]


def test_a_load_takes_no_batch_row_so_loads_start_while_every_row_runs() -> None:
    h = Store(max_batch=2)
    h.run(request(0, BS, max_tokens=40), request(1, BS, max_tokens=40))  # no lookup: 1 block
    assert h.state.seqs.num_running == 2
    h.run(request(2, 6 * BS))  # every row runs: its lookup starts all the same
    decisions = h.answer({2: 5})
    assert loads_admitted(decisions) == [2], "no load started while every row runs"
    seq = h.state.seqs.seqs[2]
    assert seq.state == SeqState.LOADING_KV and seq.row == -1
    assert h.state.seqs.num_running == 2
    assert [d.row for d in of_type(decisions, ev.KVLoadAdmitted)] == [-1]


def test_several_loads_start_in_one_step_more_than_there_are_rows() -> None:
    h = Store(max_batch=1)
    h.run(*[request(s, 4 * BS) for s in range(3)])
    decisions = h.answer({0: 3, 1: 3, 2: 3})
    assert len(of_type(decisions, ev.KVLoadStarted)) == 3
    h.finish_loads()  # the first settles into the row; the others wait for it
    h.drive()
    assert h.state.stats.requests_finished == 3


def test_a_load_holds_only_the_blocks_it_loads_into() -> None:
    h = Store()
    h.run(request(0, 100))  # 7 blocks; the store is asked for the chain blocks [0, 6)
    decisions = h.answer({0: 6})
    (allocated,) = of_type(decisions, ev.BlocksAllocated)
    assert allocated.counts.tolist() == [6], "not only the loaded blocks were taken"
    assert h.held(0) == 6 and h.state.pool.num_available == 63 - 6
    assert h.engine.policy.transfers.soft_reserved(h.state) == 1  # the prompt's last block


def test_a_soft_reservation_refuses_a_new_load_that_would_starve_an_incomplete_one() -> None:
    """Load 0 holds 2 of its 10 prompt blocks and reserves 8 of the 10 available. Load 2
    (3 blocks) would fit alone but not beside that reservation: refused. Request 1 (no hit,
    4 blocks) is an ordinary admission: it borrows reserved blocks."""
    h = Store(num_blocks=13)
    h.run(request(0, 10 * BS))
    h.answer({0: 2})
    assert h.state.pool.num_available == 10 and h.held(0) == 2
    h.run(request(1, 4 * BS), request(2, 3 * BS))
    decisions = h.answer({2: 2})  # request 1: a miss
    assert loads_admitted(decisions) == [], "a load was admitted into another's reservation"
    assert [d.seq_id for d in of_type(decisions, ev.SequenceAdmitted)] == [1]
    assert h.state.pool.num_available >= 3  # (load 2 alone would have fit)
    h.drive()
    assert h.state.stats.requests_finished == 3


def test_two_loads_whose_tails_do_not_fit_together_both_complete() -> None:
    """Loads 0 and 1 each load 4 of their 10 prompt blocks into a cache of 12: their tails
    (6 each) cannot both fit. Load 1 waits, not holding blocks, until load 0 completes; then
    it loads and completes too (neither waits on the other's blocks)."""
    h = Store(num_blocks=13)
    h.run(request(0, 10 * BS), request(1, 10 * BS))
    decisions = h.answer({0: 4, 1: 4})
    assert loads_admitted(decisions) == [0]
    assert h.state.pool.num_available == 8 and h.held(0) == 4
    h.finish_loads()
    h.drive()
    finished = h.state.stats.requests_finished
    assert finished == 2 and h.state.transfers.loaded_blocks == 8


def test_without_soft_reservations_loads_would_wait_on_each_others_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the reservation prevents: loads that make room only for the blocks they load
    (each 4 of 10) fill the cache of 12 and then none can get a block for its tail."""
    monkeypatch.setattr(Transfers, "load_need", lambda self, state, seq, first: 4)
    h = Store(num_blocks=13)
    h.run(*[request(s, 10 * BS) for s in range(3)])
    h.answer({0: 4, 1: 4, 2: 4})
    assert h.state.pool.num_available == 0
    h.finish_loads()
    with pytest.raises(AssertionError, match="not idle"):
        h.drive(steps=50)
    assert h.state.stats.requests_finished == 0


def test_a_soft_reservation_shrinks_as_the_loaded_prefill_takes_its_blocks() -> None:
    h = Store()
    transfers = h.engine.policy.transfers
    h.run(request(0, 10 * BS))
    h.answer({0: 2})
    reserved = [transfers.soft_reserved(h.state)]
    h.finish_loads()  # settled into a row: canonical chunks [32, 64), [64, 128), [128, 160)
    reserved.append(transfers.soft_reserved(h.state))
    for _ in range(2):
        h.run()
        reserved.append(transfers.soft_reserved(h.state))
    assert reserved == [8, 6, 2, 0]


def test_a_lookup_that_missed_reserves_nothing() -> None:
    """(Found by the external-KV machine: a missed lookup's record, kept while its sequence
    waits, was counted as an incomplete load, so later loads never fitted: a livelock.)"""
    h = Store(num_blocks=13)
    h.run(request(0, 10 * BS))
    h.answer({})  # a miss: it is admitted without a load
    assert h.state.transfers.load_of(0) is not None  # (the miss is remembered)
    assert h.engine.policy.transfers.soft_reserved(h.state) == 0


def test_a_load_that_ended_is_admitted_before_waiting_sequences_of_higher_priority() -> None:
    h = Store(max_batch=1, order="priority")
    h.run(request(0, BS, max_tokens=6))  # runs in the only row
    h.run(request(1, 4 * BS))
    h.answer({1: 3})  # loads without a row
    h.run(request(2, BS, priority=5))  # ordinary, and first by priority
    h.finish_loads()
    order: list[int] = []
    for _ in range(40):
        for d in h.run():
            if isinstance(d, ev.KVLoadSettled | ev.SequenceAdmitted):
                order.append(d.seq_id)
    assert order == [1, 2]


def test_a_hybrid_load_writes_its_state_to_a_slot_of_its_own_restored_into_its_row() -> None:
    h = Store(hybrid=True, checkpoint_budget=4)
    h.run(request(0, 4 * BS))
    (started,) = of_type(h.answer({0: 3}), ev.KVLoadStarted)
    ckpts = h.state.ckpts
    assert started.state_slot >= ckpts.first_ckpt_slot, "the state went to a row's slot"
    assert ckpts.load_slot_of(0) == started.state_slot
    result: StepResult = h.step([ev.KVLoadFinished(0)])
    (settled,) = of_type(result.decisions, ev.KVLoadSettled)
    runtime = ckpts.runtime_slot(h.state.seqs.seqs[0].row)
    assert (settled.state_slot, settled.num_blocks) == (started.state_slot, 3)
    assert result.plan.state_restore.tolist() == [[started.state_slot, runtime]]
    assert ckpts.load_slot_of(0) == -1  # (the slot is free again: a save may reuse it)


def test_an_abort_of_a_load_that_ended_without_a_row_releases_its_blocks_at_once() -> None:
    h = Store(max_batch=1)
    h.run(request(0, BS, max_tokens=30))
    h.run(request(1, 4 * BS))
    h.answer({1: 3})
    h.finish_loads()  # ended; the row is taken: it waits
    assert h.state.seqs.seqs[1].state == SeqState.LOADING_KV
    decisions = h.run(ev.RequestAborted(1))
    assert not of_type(decisions, ev.AbortDeferred)
    (freed,) = of_type(decisions, ev.BlocksFreed)
    assert freed.seq_ids.tolist() == [1] and len(freed.blocks) == 3
    assert [d.seq_id for d in of_type(decisions, ev.SequenceAborted)] == [1]


def test_a_drain_preempts_a_load_that_ended_without_a_row() -> None:
    h = Store(max_batch=1)
    h.run(request(0, BS, max_tokens=30))
    h.run(request(1, 4 * BS))
    h.answer({1: 3})
    h.finish_loads()
    decisions = h.run(ev.DrainRequested())
    assert [d.seq_id for d in of_type(decisions, ev.SequencePreempted)] == [1, 0]
    assert any(isinstance(d, ev.Drained) for d in decisions)
    assert int(h.state.pool.ref.sum()) == 0


def test_logs_before_schema_4_admit_a_load_with_a_row_and_every_prompt_block() -> None:
    header = Store().config.to_dict()
    header["legacy"] = {k: v for k, v in header["legacy"].items() if k != "load_admission"}
    assert SchedulerConfig.from_log_header(header, 3).legacy.load_admission == "whole_prompt"
    assert SchedulerConfig.from_log_header(header, 4).legacy.load_admission == "soft"
    h = Store(load_admission="whole_prompt")
    h.run(request(0, 100))
    decisions = h.answer({0: 6})
    (admitted,) = of_type(decisions, ev.KVLoadAdmitted)
    (allocated,) = of_type(decisions, ev.BlocksAllocated)
    assert admitted.row == 0 and allocated.counts.tolist() == [7]


def test_an_unknown_load_admission_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match="load_admission"):
        Store(load_admission="eager")
