"""External KV through the engine: two engines sharing a store, load faults, aborts, ends of
session and sleep during a load, and prefill-to-decode migration. Outputs are compared with a
cold run on the FingerprintExecutor, whose tokens depend on the KV and state contents."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.policy.helpers import Harness, of_type, prefills
from tests.replay.external_helpers import Node, config, prompt

from kvsched.connectors import InProcessStore
from kvsched.connectors.keys import block_key
from kvsched.events import types as ev
from kvsched.identity import chain_hashes, namespace_root
from kvsched.replay.external import ExternalKV
from kvsched.replay.recovery import recover
from kvsched.replay.verify import verify_log
from kvsched.statemachines import SeqState

MODELS = pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
P = prompt(300)


def cold(hybrid: bool, tokens: np.ndarray = P, max_tokens: int = 6) -> list[int]:
    node = Node(None, config(hybrid=hybrid))
    node.run([ev.RequestArrived(99, tokens, max_tokens)])
    assert node.executor.mismatches == []
    return node.outputs[99]


def saved_store(hybrid: bool, tokens: np.ndarray = P) -> InProcessStore:
    """A store holding what engine A saved while serving ``tokens``."""
    store = InProcessStore()
    a = Node(store, config(hybrid=hybrid, external_kv=True))
    a.run([ev.RequestArrived(1, tokens, 6)])
    assert a.of_type(ev.KVSaveStarted) and len(store)
    a.assert_nothing_leaks()
    return store


def serve_b(store: InProcessStore, hybrid: bool, **node_kw: object) -> Node:
    b = Node(store, config(hybrid=hybrid, external_kv=True), **node_kw)  # type: ignore[arg-type]
    b.run([ev.RequestArrived(7, P, 6)])
    return b


@MODELS
def test_engine_b_loads_what_engine_a_saved_and_computes_only_the_suffix(hybrid: bool) -> None:
    store = saved_store(hybrid)
    b = serve_b(store, hybrid)
    assert b.outputs[7] == cold(hybrid)
    assert b.executor.mismatches == []
    (load,) = b.of_type(ev.KVLoadStarted)
    assert load.first_block == 0 and len(load.blocks) == (len(P) - 1) // 16
    assert b.prefill_tokens == len(P) - len(load.blocks) * 16  # 12 of 300 tokens computed
    assert b.engine.state.stats.external_hit_tokens == 288
    b.assert_nothing_leaks()


@MODELS
def test_a_load_after_a_local_prefix_hit_loads_only_the_blocks_beyond_it(hybrid: bool) -> None:
    store = saved_store(hybrid)
    b = Node(store, config(hybrid=hybrid, external_kv=True))
    b.run([ev.RequestArrived(3, P[:100], 2)])  # computes (and caches) the first 6 blocks
    b.run([ev.RequestArrived(7, P, 6)])
    load = b.of_type(ev.KVLoadStarted)[-1]
    assert load.seq_id == 7 and load.first_block >= 4
    assert b.outputs[7] == cold(hybrid)
    b.assert_nothing_leaks()


@MODELS
def test_the_event_log_of_an_engine_with_external_kv_verifies_without_the_store(
    hybrid: bool, tmp_path: Path
) -> None:
    store = saved_store(hybrid)
    path = str(tmp_path / "b.kvlog")
    b = serve_b(store, hybrid, log_path=path)
    b.engine.log.close()  # type: ignore[union-attr]
    result = verify_log(path)
    assert result.ok and result.steps == b.engine.state.step
    assert any(isinstance(i, ev.KVLoadFinished) for i in b.inputs)


# --------------------------------------------------------------------------- faults


def _keys(hybrid: bool) -> list[str]:
    """The store keys of P's blocks in the test namespace."""
    c = config(hybrid=hybrid)
    root = namespace_root(c.model, c.block_size, "", "", c.identity)
    return [block_key(root, h) for h in chain_hashes(root, P, 16)]


@MODELS
def test_one_failing_block_among_several_keeps_the_good_ones_and_recomputes_the_rest(
    hybrid: bool,
) -> None:
    store = saved_store(hybrid)
    store.faults.fail_keys.add(_keys(hybrid)[9])
    b = serve_b(store, hybrid)
    (failed,) = [i for i in b.inputs if isinstance(i, ev.KVLoadFailed)]
    assert failed.num_good_blocks == 9
    assert b.outputs[7] == cold(hybrid)
    assert b.executor.mismatches == []
    # Attention keeps the 9 good blocks; a hybrid model has no state there and recomputes.
    assert b.prefill_tokens == (300 - 144 if not hybrid else 300)
    if hybrid:
        (pre,) = b.of_type(ev.SequencePreempted)
        assert pre.reason.startswith("kv load failed")
    else:  # the blocks the load could not bring are saved again once recomputed
        assert b.of_type(ev.KVSaveStarted)[0].first_block == 9
    b.assert_nothing_leaks()


@MODELS
def test_keys_missing_at_load_time_fail_the_load_and_the_prompt_is_recomputed(
    hybrid: bool,
) -> None:
    store = saved_store(hybrid)
    b = Node(store, config(hybrid=hybrid, external_kv=True))
    b.step([ev.RequestArrived(7, P, 6)])  # the lookup is asked (and answered) now
    store.remove(_keys(hybrid))  # evicted between the lookup and the load
    b.run()
    (failed,) = [i for i in b.inputs if isinstance(i, ev.KVLoadFailed)]
    assert failed.num_good_blocks == 0 and "missing" in failed.reason
    assert b.outputs[7] == cold(hybrid)
    assert b.prefill_tokens == 300
    b.assert_nothing_leaks()


@MODELS
def test_a_store_that_dies_during_the_load_fails_it_and_the_prompt_is_still_served(
    hybrid: bool,
) -> None:
    store = saved_store(hybrid)
    store.faults.fail_after_gets = 5  # the store goes away after 5 block reads
    b = serve_b(store, hybrid)
    (failed,) = [i for i in b.inputs if isinstance(i, ev.KVLoadFailed)]
    assert failed.num_good_blocks <= 5
    assert b.outputs[7] == cold(hybrid)
    assert b.executor.mismatches == []
    b.assert_nothing_leaks()


def test_an_unreachable_store_answers_lookups_with_no_blocks_and_nothing_waits() -> None:
    store = saved_store(False)
    store.faults.unavailable = True
    b = serve_b(store, False)
    assert not b.of_type(ev.KVLoadStarted)
    assert b.outputs[7] == cold(False) and b.prefill_tokens == 300
    b.assert_nothing_leaks()


class GatedProbes:
    """A store whose lookups (``batch_exists`` on the connector's lookup thread) block until
    the test opens the gate."""

    def __init__(self, inner: InProcessStore) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if threading.current_thread().name.startswith("kvlookup"):  # saves probe too
            self.gate.wait(timeout=10)
        return self.inner.batch_exists(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_pending_lookup_keeps_its_request_waiting_while_others_are_served() -> None:
    store = GatedProbes(saved_store(False))
    b = Node(store, config(external_kv=True), async_lookups=True)  # type: ignore[arg-type]
    other = prompt(12, seed=9)  # shorter than a block: nothing to look up
    b.step([ev.RequestArrived(7, P, 6), ev.RequestArrived(8, other, 3)])
    for _ in range(8):
        b.step()
        assert b.engine.state.seq(7).state == SeqState.WAITING
    assert not any(isinstance(i, ev.KVLookupAnswered) for i in b.inputs)
    assert len(b.outputs[8]) == 3  # served meanwhile
    store.gate.set()
    b.run()
    assert b.outputs[7] == cold(False) and len(b.of_type(ev.KVLoadStarted)) == 1
    b.assert_nothing_leaks()


def test_a_lookup_that_times_out_answers_no_blocks_and_the_prompt_is_computed() -> None:
    store = GatedProbes(saved_store(False))  # the gate never opens
    b = Node(store, config(external_kv=True), async_lookups=True, lookup_timeout_s=0.05)  # type: ignore[arg-type]
    b.run([ev.RequestArrived(7, P, 6)])
    assert not b.of_type(ev.KVLoadStarted)
    assert b.outputs[7] == cold(False) and b.prefill_tokens == 300
    store.gate.set()
    b.assert_nothing_leaks()


# ------------------------------------------------------------ answers beyond the question


@MODELS
def test_a_store_answer_beyond_the_blocks_asked_loads_only_the_range_the_lookup_asked(
    hybrid: bool,
) -> None:
    h = Harness(config(hybrid=hybrid, external_kv=True))  # the test is the store
    asked = of_type(h.step([ev.RequestArrived(7, P[:100], 2)]).decisions, ev.KVLookupStarted)
    assert [(a.seq_id, a.first_block, a.num_blocks) for a in asked] == [(7, 0, 6)]
    result = h.step([ev.KVLookupAnswered(7, 9)])  # claims 3 blocks more than asked
    (admit,) = of_type(result.decisions, ev.KVLoadAdmitted)
    (load,) = of_type(result.decisions, ev.KVLoadStarted)
    assert (admit.first_block, admit.num_blocks) == (0, 6)
    assert (load.first_block, len(load.blocks)) == (0, 6)
    assert h.state.stats.external_hit_tokens == 6 * 16
    reports: list[ev.Event] = [ev.KVLoadFinished(7)]
    computed = []
    for _ in range(20):
        result = h.step(reports)
        computed += [(s, e) for _, s, e in prefills(result)]
        saves = of_type(result.decisions, ev.KVSaveStarted)
        reports = [ev.KVSaveFinished(d.save_id) for d in saves]
        if not h.engine.has_work and not h.outcome and not reports:
            break
    assert computed[0] == (96, 100)  # the prompt's tail beyond the 6 loaded blocks
    assert h.state.stats.requests_finished == 1


# ---------------------------------------------------- aborts, sessions, sleep mid-load


def _slow_store(hybrid: bool) -> InProcessStore:
    store = saved_store(hybrid)
    store.faults.get_delay_s = 0.15
    return store


def _start_load(b: Node, request: ev.RequestArrived) -> None:
    b.step([request])
    b.step()
    assert b.engine.state.seq(request.seq_id).state == SeqState.LOADING_KV


@MODELS
def test_an_abort_during_a_load_is_deferred_and_applied_once_when_it_settles(
    hybrid: bool,
) -> None:
    b = Node(_slow_store(hybrid), config(hybrid=hybrid, external_kv=True), synchronous=False)
    _start_load(b, ev.RequestArrived(7, P, 6))
    b.step([ev.RequestAborted(7), ev.RequestAborted(7, "again")])
    assert len(b.of_type(ev.AbortDeferred)) == 1 and not b.of_type(ev.SequenceAborted)
    b.run()
    (aborted,) = b.of_type(ev.SequenceAborted)
    assert aborted.reason == "client abort"
    assert 7 not in b.outputs
    b.assert_nothing_leaks()


@MODELS
def test_an_end_of_session_during_a_load_closes_the_session_once_the_load_settles(
    hybrid: bool,
) -> None:
    b = Node(_slow_store(hybrid), config(hybrid=hybrid, external_kv=True), synchronous=False)
    _start_load(b, ev.RequestArrived(7, P, 6, session_id=3))
    b.step([ev.SessionEnded(3)])
    assert b.of_type(ev.AbortDeferred) and not b.of_type(ev.SessionClosed)
    b.run()
    assert [d.session_id for d in b.of_type(ev.SessionClosed)] == [3]
    assert len(b.of_type(ev.SequenceAborted)) == 1
    assert 3 not in b.engine.state.sessions
    b.assert_nothing_leaks()


def test_an_abort_then_an_end_of_session_during_a_load_abort_once_and_close_the_session() -> None:
    b = Node(_slow_store(False), config(external_kv=True), synchronous=False)
    _start_load(b, ev.RequestArrived(7, P, 6, session_id=3))
    b.step([ev.RequestAborted(7), ev.SessionEnded(3), ev.SessionEnded(3)])
    assert len(b.of_type(ev.AbortDeferred)) == 2  # the second one adds the session's end
    b.run()
    assert [d.reason for d in b.of_type(ev.SequenceAborted)] == ["client abort"]
    assert [d.session_id for d in b.of_type(ev.SessionClosed)] == [3]
    b.assert_nothing_leaks()


@MODELS
def test_sleep_during_a_load_waits_for_it_then_drains_and_serving_resumes(hybrid: bool) -> None:
    b = Node(_slow_store(hybrid), config(hybrid=hybrid, external_kv=True), synchronous=False)
    _start_load(b, ev.RequestArrived(7, P, 6))
    b.step([ev.DrainRequested()])
    assert b.of_type(ev.DrainDeferred) and not b.of_type(ev.Drained)
    b.run()
    assert b.of_type(ev.Drained) and b.engine.state.sleeping
    assert int(b.engine.state.pool.ref.sum()) == 0
    b.run([ev.WakeRequested()])
    assert b.outputs[7] == cold(hybrid)  # preempted by the drain, served after waking
    b.assert_nothing_leaks()


def test_after_a_crash_mid_load_the_lost_transfers_are_failed_and_nothing_leaks(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "crash.kvlog")
    b = Node(_slow_store(False), config(external_kv=True), synchronous=False, log_path=path)
    b.run([ev.RequestArrived(3, prompt(40, seed=3), 2)])  # leaves a save or two behind it
    _start_load(b, ev.RequestArrived(7, P, 6))
    b.engine.log.flush()  # type: ignore[union-attr]  # the process dies here:
    b.engine.log.close()  # type: ignore[union-attr]  # its file (and the log's lock) is released
    recovered = recover(path, check_invariants=True)
    engine = recovered.engine
    loads, saves = engine.transfers_in_flight()
    assert loads == [7]
    lost = ExternalKV.recovered_inputs(engine)
    assert [type(e) for e in lost] == [ev.KVLoadFailed] + [ev.KVSaveFinished] * len(saves)
    after = Node(InProcessStore(), config(external_kv=True))  # the restarted process
    after.engine = engine
    if not recovered.resume.plan.is_empty:  # the last step's outcome died with the process
        after.pending = [after.executor.execute(recovered.resume.plan)]
    after.run(lost)
    assert after.outputs[7] == cold(False)
    after.assert_nothing_leaks()


# --------------------------------------------------------------------------- migration


@MODELS
@pytest.mark.parametrize("length", [300, 320], ids=["unaligned", "aligned"])
def test_a_prefill_role_engine_hands_its_prompt_to_a_decode_role_engine(
    hybrid: bool, length: int
) -> None:
    tokens = prompt(length, seed=4)
    store = InProcessStore()
    pre = Node(store, config(hybrid=hybrid, external_kv=True, role="prefill"))
    pre.run([ev.RequestArrived(1, tokens, 8)])
    (done,) = pre.of_type(ev.SequenceFinished)
    assert done.reasons == ("migrated",) and len(pre.outputs[1]) == 1
    pre.assert_nothing_leaks()
    first = pre.outputs[1][0]
    dec = Node(store, config(hybrid=hybrid, external_kv=True, role="decode"))
    handed = np.append(tokens, np.int32(first))
    dec.run([ev.RequestArrived(1, handed, 7)])
    assert [first, *dec.outputs[1]] == cold(hybrid, tokens, 8)
    assert dec.executor.mismatches == []
    assert dec.prefill_tokens <= 16  # only the prompt's partial tail block (and the token)
    assert not dec.of_type(ev.KVSaveStarted)  # the decode role saves nothing
    dec.assert_nothing_leaks()


def test_a_role_needs_external_kv_and_must_be_known() -> None:
    with pytest.raises(ValueError, match=r"needs external\.enabled"):
        config(role="prefill")
    with pytest.raises(ValueError, match=r"unknown external\.role"):
        config(external_kv=True, role="router")
