"""Whole-engine property test with an external KV store: a hypothesis state machine drives an
engine with ``external_kv=True`` (attention or hybrid; roles both, prefill and decode; loads
admitted under soft reservations without a row, or with a row and every prompt block) and a
fake store that works at the event level (no bytes). The fake records, from each step's
decisions, the lookups outstanding, the loads and the saves in flight, and answers or reports
chosen subsets of them at chosen steps, in any order, among arrivals, bursts of loads, aborts,
session ends, executor failures and sleep/wake.

Besides every owner's invariants (checked by the engine after every step), the machine checks
the protocol: every lookup is answered or cancelled, every load and save is reported exactly
once, a deferred abort happens exactly once when its load ends, a deferred drain happens as
soon as the last transfer ends, a loading sequence is owed a report or waits for a row, the
incomplete loads always fit the cache together (no load can wait on another's blocks), and
at the end (a prompt store, no new work) the engine drains to idle and nothing is held.
Deliberately broken owners must be caught."""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from tests.mtp_images import IMAGES, SpansWhole, with_image
from tests.overlapped import overlap, step_after_next
from tests.planted import assert_machine_catches
from tests.policy.helpers import Harness

from kvsched.config import ModelSpec, Preemption, SchedulerConfig, Speculation
from kvsched.engine import Engine, LookupAnswer
from kvsched.events import types as ev
from kvsched.events.codec import SCHEMA_VERSION
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.policy.scheduler import Policy
from kvsched.policy.transfers import Transfers
from kvsched.reducers.pipeline import PipelinedRows
from kvsched.reducers.transfers import TransferTable
from kvsched.statemachines import CkptState, LoadState, SeqState

VOCAB = 97
PREFIXES = [
    np.arange(1, 1 + n, dtype=np.int32) * (i + 2) % VOCAB + 1 for i, n in enumerate((8, 20, 33))
]
NUM_SESSIONS = 2
T = TypeVar("T")
Reports = list[ev.Event] | tuple[ev.Event, ...]
REQUEST = st.tuples(
    st.integers(0, len(PREFIXES) - 1),  # shared prefix
    st.integers(0, 9),  # suffix length
    st.integers(1, 12),  # max_tokens
    st.sampled_from(["", "lora-a"]),  # adapter
    st.integers(0, 2),  # priority
    st.sampled_from([-1, -1, 0, 1]),  # session
)


def _pick_with(keys: list[int], choices: list[tuple[int, T]]) -> list[tuple[int, T]]:
    """The distinct keys chosen by ``choices`` (index modulo the number of keys, parameter),
    each with the parameter of its first choice."""
    chosen: dict[int, T] = {}
    for i, param in choices:
        if keys:
            chosen.setdefault(keys[i % len(keys)], param)
    return list(chosen.items())


# The external-KV machines' configuration space (each start draws one).
EXTERNAL_CONFIGS = dict(
    hybrid=st.booleans(),
    role=st.sampled_from(["both", "both", "prefill", "decode"]),
    num_blocks=st.integers(12, 32),
    max_batch=st.integers(1, 4),
    chunk_blocks=st.integers(1, 3),
    decode_interval=st.sampled_from([0, 4, 8]),
    budget=st.integers(1, 4),
    turn_mode=st.sampled_from(["mixed", "alternate"]),
    order=st.sampled_from(["fcfs", "priority", "ttft"]),  # ttft: its prefill turns
    load_admission=st.sampled_from(["soft", "soft", "whole_prompt"]),
)


def _port(answers: list[tuple[int, bool]]) -> Any:
    """A lookup port answering the step's lookups in turn: each (depth, synchronous load),
    the depth as ``_answer``'s (quarters of the asked range; -1, or none left: not known
    yet)."""

    def answer(e: ev.KVLookupStarted) -> LookupAnswer | None:
        depth, sync = answers.pop(0) if answers else (-1, False)
        if depth < 0:
            return None
        return LookupAnswer(e.first_block + (e.num_blocks - e.first_block) * depth // 4, sync)

    return answer


class ExternalKVMachine(RuleBasedStateMachine):
    """The engine and a fake store; the model is "what the store owes the engine"."""

    @initialize(**EXTERNAL_CONFIGS)
    def start(  # type: ignore[no-untyped-def]
        self,
        hybrid,
        role,
        num_blocks,
        max_batch,
        chunk_blocks,
        decode_interval,
        budget,
        turn_mode,
        order,
        load_admission="soft",
    ):
        bs = 4
        self.config = SchedulerConfig.from_log_header(
            dict(
                model=ModelSpec(vocab_size=VOCAB, max_context=128),
                block_size=bs,
                num_blocks=num_blocks,
                max_batch=max_batch,
                max_prefill_tokens=bs * chunk_blocks,
                hybrid=hybrid,
                checkpoint_budget=budget,
                decode_checkpoint_interval=decode_interval,
                turn_mode=turn_mode,
                order=order,
                external_kv=True,
                role=role,
                load_admission=load_admission,
            ),
            SCHEMA_VERSION,
        )
        self.engine = Engine(self.config, check_invariants=True)
        self.executor = SimulatedExecutor(VOCAB)
        self.outcome: list[ev.Event] = []
        self.inputs: list[ev.Event] = []
        self.next_id = 0
        self.clock = 0.0
        self.drained = False
        self.failed = False
        # The fake store: what it owes the engine.
        self.lookups: dict[int, tuple[int, int]] = {}  # seq id -> (first, end) asked
        self.loads: dict[int, int] = {}  # seq id -> blocks being loaded
        self.ready: set[int] = set()  # loads reported, their sequences not yet in a row
        self.saves: set[int] = set()  # save ids in flight
        # The model of the protocol.
        self.deferred_aborts: dict[int, bool] = {}  # seq id -> close its session too
        self.drain_deferred = False
        self.cancelled_lookups: set[int] = set()  # their late answers must be ignored
        self.sync_offered: set[int] = set()  # answered with a synchronous load
        self.failed_loads: set[int] = set()  # sequences whose load failed: never looked up again
        self.retired: set[int] = set()
        self.session_of: dict[int, int] = {}
        self.ended_sessions: set[int] = set()  # ended by the client, not reopened since
        self.want_sleep = False  # the latest of DrainRequested / WakeRequested

    # ------------------------------------------------------------------------ driving

    def _step(
        self,
        reports: Reports = (),
        *,
        fail: bool = False,
        reports_first: bool = True,
        in_step: list[tuple[int, bool]] | None = None,
    ) -> tuple[ev.Event, ...]:
        """One engine step fed the executor's outcome, the store's ``reports`` and the
        client's inputs (reports first or last), with a lookup port answering the step's
        lookups in turn from ``in_step`` (``_port``); every protocol check follows."""
        self.failed = True  # until the step and every check passed (teardown then skips)
        if reports_first:
            inputs = [*self.outcome, *reports, *self.inputs]
        else:
            inputs = [*self.outcome, *self.inputs, *reports]
        port = None if in_step is None else _port(list(in_step))
        result = self.engine.step(inputs, self.clock, port)
        self.inputs, self.outcome = [], []
        self.clock += 0.01
        self._settle_reports(reports)
        self._check_decisions(reports, result.decisions)
        self._follow_client(inputs, result.decisions)
        self._check_after_step()
        self.drained = any(isinstance(d, ev.Drained) for d in result.decisions)
        if not result.plan.is_empty:
            if fail:
                self.outcome = [ev.StepFailed(result.plan.step, "injected fault")]
            else:
                self.outcome = [self.executor.execute(result.plan)]
        self.failed = False
        return result.decisions

    def _in_flight(self) -> bool:
        """Transfers a drain waits for."""
        return bool(self.loads or self.saves)

    def _settle_reports(self, reports: Reports) -> None:
        """The reports delivered this step are no longer owed."""
        for r in reports:
            if isinstance(r, ev.KVLookupAnswered):
                if not r.pending:
                    self.lookups.pop(r.seq_id, None)
                if r.sync_load:
                    self.sync_offered.add(r.seq_id)
            elif isinstance(r, ev.KVLoadFinished | ev.KVLoadFailed):
                del self.loads[r.seq_id]
                self.ready.add(r.seq_id)  # (until settled into a row, preempted or aborted)
                if isinstance(r, ev.KVLoadFailed):
                    self.failed_loads.add(r.seq_id)
            elif isinstance(r, ev.KVSaveFinished):
                self.saves.remove(r.save_id)

    def _check_decisions(self, reports: Reports, decisions: tuple[ev.Event, ...]) -> None:
        """Follow the decisions in order: what the store now owes, and the protocol."""
        settled = {r.seq_id for r in reports if isinstance(r, ev.KVLoadFinished | ev.KVLoadFailed)}
        closed: set[int] = set()
        for d in decisions:
            if isinstance(d, ev.KVLookupStarted):
                if d.sync_load:
                    self.sync_offered.add(d.seq_id)
                assert d.seq_id not in self.lookups, f"second lookup of {d.seq_id} outstanding"
                assert d.seq_id not in self.loads, f"lookup of {d.seq_id} while it loads"
                assert d.seq_id not in self.failed_loads, f"{d.seq_id} retries a failed store"
                assert 0 <= d.first_block < d.num_blocks, d
                assert d.with_state == self.config.hybrid
                if d.answer < 0:  # (else answered within the step: nothing is owed)
                    self.lookups[d.seq_id] = (d.first_block, d.num_blocks)
            elif isinstance(d, ev.KVLoadCancelled):
                assert d.seq_id not in self.loads, f"load of {d.seq_id} cancelled in flight"
                if self.lookups.pop(d.seq_id, None) is not None:
                    self.cancelled_lookups.add(d.seq_id)
            elif isinstance(d, ev.KVLoadAdmitted):
                assert d.seq_id not in self.lookups, f"{d.seq_id} admitted to load, unanswered"
                assert d.seq_id not in self.failed_loads, f"{d.seq_id} retries a failed store"
                assert (d.row < 0) == self.config.soft_loads, "a soft load took a row"
            elif isinstance(d, ev.KVLoadSettled):
                assert d.seq_id in self.ready, f"{d.seq_id} settled, but its load did not end"
                self.ready.discard(d.seq_id)
            elif isinstance(d, ev.SequencePreempted):
                self.ready.discard(d.seq_id)
            elif isinstance(d, ev.KVLoadStarted):
                assert d.seq_id not in self.loads, f"second load of {d.seq_id} in flight"
                assert len(d.blocks) or self.config.hybrid  # (hybrid: maybe only the state)
                assert (d.state_slot >= 0) == self.config.hybrid
                if d.synchronous:  # (ended when started: nothing is owed, it waits to settle)
                    assert d.seq_id in self.sync_offered, f"{d.seq_id} loads synchronously"
                    self.ready.add(d.seq_id)
                else:
                    self.loads[d.seq_id] = len(d.blocks)
            elif isinstance(d, ev.KVSaveStarted):
                assert self.config.external.role != "decode", "a decode-role engine saved"
                assert d.save_id not in self.saves, f"save id {d.save_id} reused"
                assert len(d.blocks) > 0
                assert not self.drain_deferred, "a save started while a drain waits"
                self.saves.add(d.save_id)
            elif isinstance(d, ev.AbortDeferred):
                loads = d.seq_id in self.loads or d.seq_id in settled
                assert loads, f"abort of {d.seq_id} deferred, but it loads nothing"
                # (deferred again only to add the end of its session)
                again = self.deferred_aborts.get(d.seq_id)
                assert again is None or (d.close_session and not again), (
                    f"abort of {d.seq_id} deferred twice"
                )
                self.deferred_aborts[d.seq_id] = d.close_session or bool(again)
            elif isinstance(d, ev.SequenceAborted):
                self.ready.discard(d.seq_id)
                assert d.seq_id not in self.retired, f"{d.seq_id} retired twice"
                assert d.seq_id not in self.loads, f"{d.seq_id} aborted while its load flies"
                assert d.seq_id not in self.lookups, f"{d.seq_id} aborted, lookup outstanding"
                if d.seq_id in self.deferred_aborts:
                    assert d.seq_id in settled, f"deferred abort of {d.seq_id} before it settled"
                    if self.deferred_aborts.pop(d.seq_id):
                        closed.add(self.session_of[d.seq_id])
                self.retired.add(d.seq_id)
            elif isinstance(d, ev.SequenceFinished):
                for seq_id in d.seq_ids.tolist():
                    assert seq_id not in self.retired, f"{seq_id} retired twice"
                    assert seq_id not in self.loads and seq_id not in self.lookups
                    assert seq_id not in self.deferred_aborts, f"{seq_id} finished, abort pending"
                    self.retired.add(seq_id)
            elif isinstance(d, ev.SessionClosed):
                closed.discard(d.session_id)
            elif isinstance(d, ev.DrainDeferred):
                assert not self.drain_deferred, "drain deferred twice"
                assert self._in_flight(), "drain deferred with nothing in flight"
                self.drain_deferred = True
            elif isinstance(d, ev.Woken):
                self.drain_deferred = False  # a wake cancels a drain still waiting
            elif isinstance(d, ev.Drained):
                assert not self._in_flight(), "drained with transfers in flight"
                assert not self.lookups, f"drained with lookups outstanding {self.lookups}"
                self.drain_deferred = False
        for seq_id in settled:
            # (b) a deferred abort happens, exactly once, in the step its load's report arrives.
            assert seq_id not in self.deferred_aborts, f"deferred abort of {seq_id} never happened"
        assert not closed, f"sessions {sorted(closed)} not closed after their deferred end"
        # (c) a deferred drain happens as soon as nothing is in flight.
        assert not (self.drain_deferred and not self._in_flight()), (
            "every transfer settled, but the deferred drain did not happen"
        )

    def _follow_client(self, inputs: list[ev.Event], decisions: tuple[ev.Event, ...]) -> None:
        rejected = {d.seq_id for d in decisions if isinstance(d, ev.RequestRejected)}
        for e in inputs:
            if isinstance(e, ev.DrainRequested | ev.WakeRequested):
                self.want_sleep = isinstance(e, ev.DrainRequested)
            elif isinstance(e, ev.SessionEnded):
                self.ended_sessions.add(e.session_id)
            elif isinstance(e, ev.RequestArrived) and e.seq_id not in rejected:
                self.session_of[e.seq_id] = e.session_id
                self.ended_sessions.discard(e.session_id)

    def _check_after_step(self) -> None:
        state = self.engine.state
        seqs = state.seqs.seqs
        # (a) no sequence loads without the store owing its report (or, its report given,
        # waiting for a row), and conversely.
        loading = {s for s, q in seqs.items() if q.state == SeqState.LOADING_KV}
        owed = set(self.loads) | self.ready
        assert loading == owed, f"loading {sorted(loading)}, store {self.loads} {self.ready}"
        pending = {
            s: (ld.first_block, ld.num_blocks)
            for s, ld in state.transfers.loads.items()
            if ld.state == LoadState.LOOKUP_PENDING
        }
        assert pending == self.lookups, f"engine awaits {pending}, store owes {self.lookups}"
        assert set(state.transfers.leases) == self.saves
        for seq_id in self.deferred_aborts:
            assert seq_id in self.loads
        # The engine sleeps iff the client's latest request was to sleep (a drain waiting for
        # transfers to settle is not asleep yet).
        if not state.serving.drain_pending:
            assert state.sleeping == self.want_sleep, (
                "asleep after a wake" if state.sleeping else "awake after a drain"
            )
        # A session the client ended is gone, or goes once its active turn's load settles.
        for session_id in self.ended_sessions:
            session = state.sessions.get(session_id)
            if session is None:
                continue
            load = state.transfers.load_of(session.active_seq)
            assert load is not None and load.close_session, (
                f"session {session_id} was ended but is still open"
            )

    def _answer(self, seq_id: int, depth: int, sync: bool = False) -> ev.KVLookupAnswered:
        """depth -1: 'still pending'; 0: a miss; 1..4: that many quarters of the range
        (``sync``: loaded synchronously)."""
        first, end = self.lookups[seq_id]
        if depth < 0:
            return ev.KVLookupAnswered(seq_id, first, pending=True)
        return ev.KVLookupAnswered(seq_id, first + (end - first) * depth // 4, sync_load=sync)

    def _all_reports(self, ok: bool = True) -> list[ev.Event]:
        out: list[ev.Event] = [self._answer(s, 4) for s in sorted(self.lookups)]
        for s, n in sorted(self.loads.items()):
            out.append(ev.KVLoadFinished(s) if ok else ev.KVLoadFailed(s, n // 2, "store down"))
        out += [ev.KVSaveFinished(s, ok) for s in sorted(self.saves)]
        return out

    # -------------------------------------------------------------------------- rules

    @rule(requests=st.lists(REQUEST, min_size=1, max_size=3))
    def arrive(self, requests: list[tuple[int, int, int, str, int, int]]) -> None:
        for prefix, suffix, max_tokens, adapter, priority, session in requests:
            prompt = np.concatenate([PREFIXES[prefix], np.full(suffix, 5, np.int32)])
            self.inputs.append(
                ev.RequestArrived(
                    self.next_id,
                    prompt,
                    max_tokens,
                    arrival_time=self.clock,
                    priority=priority,
                    session_id=session,
                    adapter=adapter,
                )
            )
            self.next_id += 1

    @rule(
        answers=st.lists(
            st.tuples(st.integers(0, 7), st.tuples(st.integers(-1, 4), st.booleans())),
            max_size=3,
        ),
        finishes=st.lists(st.integers(0, 3), max_size=2),
        failures=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 8)), max_size=2),
        saves=st.lists(st.tuples(st.integers(0, 7), st.booleans()), max_size=3),
        stale=st.booleans(),
        reports_first=st.booleans(),
        executor_raises=st.booleans(),
        in_step=st.none() | st.lists(st.tuples(st.integers(-1, 4), st.booleans()), max_size=3),
    )
    def step(  # type: ignore[no-untyped-def]
        self, answers, finishes, failures, saves, stale, reports_first, executor_raises, in_step
    ):
        """One step whose inputs carry some of what the store owes, before or after the
        client's inputs: lookup answers (pending, miss, or a hit of some depth), loads
        finished or failed (with some good leading blocks), saves confirmed or failed; maybe
        the late answer of a lookup cancelled meanwhile (it must be ignored); maybe a store
        that answers the step's own lookups within it (a lookup port). The executor runs the
        step's plan, or raises."""
        reports: list[ev.Event] = []
        for seq_id, (depth, sync) in _pick_with(sorted(self.lookups), answers):
            reports.append(self._answer(seq_id, depth, sync))
        loads = sorted(self.loads)
        failing = _pick_with(loads, failures)
        for seq_id, good in failing:
            reports.append(ev.KVLoadFailed(seq_id, good % (self.loads[seq_id] + 1), "injected"))
        failed = {seq_id for seq_id, _ in failing}
        for seq_id, _ in _pick_with(loads, [(i, None) for i in finishes]):
            if seq_id not in failed:
                reports.append(ev.KVLoadFinished(seq_id))
        for save_id, ok in _pick_with(sorted(self.saves), saves):
            reports.append(ev.KVSaveFinished(save_id, ok))
        late = sorted(self.cancelled_lookups - set(self.lookups))
        if stale and late:
            reports.append(ev.KVLookupAnswered(late[-1], 1 << 20))
        self._step(reports, fail=executor_raises, reports_first=reports_first, in_step=in_step)

    @rule(
        n=st.integers(2, 5),
        prefix=st.integers(0, len(PREFIXES) - 1),
        depth=st.integers(1, 4),
        ok=st.booleans(),
        synchronous=st.booleans(),
        sync_loads=st.booleans(),
    )
    def load_burst(  # type: ignore[no-untyped-def]
        self, n, prefix, depth, ok, synchronous, sync_loads
    ) -> None:
        """Several requests on one prefix arrive at once; the store answers every lookup with
        ``depth`` quarters of its range (at the next step, or, ``synchronous``, within the
        step that asks; ``sync_loads``: loaded within the step that starts them), then
        finishes (or fails) every load it owes, step after step: loads start several to a
        step, with tails (the rest of each prompt) that may not fit the cache together."""
        for i in range(n):
            prompt = np.concatenate([PREFIXES[prefix], np.full(3 + 2 * i, 7, np.int32)])
            self.inputs.append(ev.RequestArrived(self.next_id, prompt, 2, arrival_time=self.clock))
            self.next_id += 1
        self._step(in_step=[(depth, sync_loads)] * n if synchronous else None)
        self._step([self._answer(s, depth, sync_loads) for s in sorted(self.lookups)])
        for _ in range(3):
            self._step(self._all_reports(ok=ok)[len(self.lookups) :])

    @rule(n=st.integers(1, 6), store=st.sampled_from(["silent", "prompt", "failing"]))
    def run_steps(self, n: int, store: str) -> None:
        """Several steps; at each, a silent store reports nothing, a prompt one answers and
        reports everything it owes, a failing one answers every lookup but fails every load
        (half its blocks good) and every save."""
        for _ in range(n):
            self._step(self._all_reports(ok=store == "prompt") if store != "silent" else ())

    @rule(pick=st.integers(0, 7), loading=st.booleans())
    def abort(self, pick: int, loading: bool) -> None:
        """Abort a loading sequence (its transfer in flight or ended), or any live one (or an
        unknown id when none is)."""
        owed = sorted(set(self.loads) | self.ready)
        live = owed if loading and owed else sorted(self.engine.state.seqs.seqs)
        self.inputs.append(ev.RequestAborted(live[pick % len(live)] if live else pick))

    @precondition(lambda self: self.loads)
    @rule(
        pick=st.integers(0, 3),
        how=st.sampled_from(["abort", "end session", "abort, then end session"]),
        report=st.sampled_from(["later", "finished", "failed"]),
    )
    def abort_while_loading(self, pick: int, how: str, report: str) -> None:
        """Abort a sequence whose KV is loading (or end its session, or both) in a step that
        brings no report of its load: deferred until the load settles (maybe in the next
        step). A report given in the same step as the abort is applied first (outcomes and
        reports come before client inputs), so that abort is not deferred at all."""
        seq_id = sorted(self.loads)[pick % len(self.loads)]
        session = self.session_of.get(seq_id, -1)
        if how != "end session" or session < 0:
            self.inputs.append(ev.RequestAborted(seq_id, "client abort"))
        if how != "abort" and session >= 0:
            self.inputs.append(ev.SessionEnded(session))
        self._step()
        if report != "later" and seq_id in self.loads:
            n = self.loads[seq_id]
            ok = report == "finished"
            report_ = ev.KVLoadFinished(seq_id) if ok else ev.KVLoadFailed(seq_id, n // 2, "x")
            self._step([report_], reports_first=False)

    @rule(session=st.integers(0, NUM_SESSIONS - 1))
    def end_session(self, session: int) -> None:
        self.inputs.append(ev.SessionEnded(session))

    @rule(wake=st.booleans())
    def sleep(self, wake: bool) -> None:
        """Drain (maybe deferred, while transfers fly); maybe ask to wake at the next step."""
        self.inputs.append(ev.DrainRequested())
        self._step()
        if wake:
            self.inputs.append(ev.WakeRequested())

    @rule()
    def wake(self) -> None:
        self.inputs.append(ev.WakeRequested())

    # --------------------------------------------------------------------- invariants

    @invariant()
    def owners_are_consistent(self) -> None:
        self.engine.state.check_invariants()

    @invariant()
    def after_drain_nothing_is_held(self) -> None:
        state = self.engine.state
        if self.drained:
            assert state.pool.ref.sum() == 0
            assert not state.ckpts.ckpts and not state.pool.index
            assert state.seqs.num_running == 0
            assert not state.transfers.leases and not state.transfers.busy

    @invariant()
    def admitted_loads_fit_the_cache_together(self) -> None:
        """Soft loads: the blocks the incomplete loads hold (without a row, or settled and
        still prefilling) plus the prompt blocks they still lack never exceed the cache, so
        every one of them can complete once the blocks ordinary work borrowed come back: no
        load ever waits on another load's blocks (the teardown then drains to idle)."""
        if not self.config.soft_loads:
            return
        state, bs = self.engine.state, self.config.block_size
        held: set[int] = set()
        lacking = 0
        for seq_id, load in state.transfers.loads.items():
            if not load.admitted:
                continue
            seq = state.seqs.seqs[seq_id]
            blocks = state.seqs.block_table(seq)
            prompt = -(-seq.n_prompt // bs)
            if len(blocks) < prompt:
                held.update(blocks.tolist())
                lacking += prompt - len(blocks)
        assert len(held) + lacking <= self.config.num_blocks - 1, (
            f"incomplete loads hold {len(held)} blocks and lack {lacking}: more than the cache"
        )
        assert all(s.row < 0 for s in state.seqs.seqs.values() if s.state == SeqState.LOADING_KV), (
            "a soft load holds a batch row"
        )

    @invariant()
    def pinned_checkpoints_are_pinned_by_running_sequences_or_saves(self) -> None:
        state = self.engine.state
        leased = state.transfers.lease_pins()
        for c in state.ckpts.ckpts.values():
            if c.state == CkptState.PINNED:
                users = [s for s in state.seqs.seqs.values() if s.pinned_ckpt == c.ckpt_id]
                assert all(s.row >= 0 for s in users)
                assert users or leased.get(c.ckpt_id)

    def teardown(self) -> None:
        if not hasattr(self, "engine") or self.failed:
            return  # (a failed step already reported; do not pile a teardown error on it)
        # (d) The store delivers everything it owes, the engine finishes its work (a waking
        # engine, reports as they become due), then sleeps: nothing at all is held.
        self.inputs.append(ev.WakeRequested())
        idle = 0
        for _ in range(2000):
            owed = self.lookups or self.loads or self.saves or self.outcome or self.inputs
            if not owed and not self.engine.has_work and not self.engine.state.sleeping:
                break
            if self.engine.state.sleeping and not self.inputs:
                self.inputs.append(ev.WakeRequested())
            reports = self._all_reports()
            fed = bool(reports or self.inputs or self.outcome)
            decisions = self._step(reports)
            # Nothing fed and nothing decided: the next step is the same (fcfs; priority
            # aging takes far longer than this), so the engine is stuck.
            idle = 0 if fed or len(decisions) > 1 else idle + 1
            waiting = sorted(self.engine.state.seqs.waiting)
            ready = self.engine.state.transfers.ready_loads()  # (loaded, waiting for a row)
            assert idle < 20, (
                f"livelock: sequences {waiting} and loads {ready} wait, but nothing is decided"
            )
        assert not self.engine.has_work, "the engine did not finish its work"
        assert not (self.lookups or self.loads or self.saves or self.ready)
        self.inputs = [ev.SessionEnded(s) for s in range(NUM_SESSIONS)] + [ev.DrainRequested()]
        decisions = self._step()
        assert any(isinstance(d, ev.Drained) for d in decisions)
        state = self.engine.state
        assert int(state.pool.ref.sum()) == 0, "block references leaked"
        assert not state.transfers.leases, "save leases leaked"
        assert not state.transfers.loads, "load records leaked"
        assert not state.ckpts.ckpts, "checkpoints leaked"
        assert not state.sessions, "sessions leaked"
        assert not state.pool.index


ExternalKVMachine.TestCase.settings = settings(
    max_examples=max(60, settings.default.max_examples), stateful_step_count=40, deadline=None
)
TestExternalKVStateMachine = ExternalKVMachine.TestCase


class ExternalKVMachineWithMTPAndImages(ExternalKVMachine):
    """The same machine with MTP (an attention model loads one block less than the store
    has: recomputed) and requests with multimodal spans: no load, hit or chunk ends inside
    one."""

    @initialize(**EXTERNAL_CONFIGS, mtp=st.sampled_from([0, 1]))
    def start(self, mtp: int, **kw) -> None:  # type: ignore[no-untyped-def]
        super().start(**kw)
        self.config = attrs.evolve(self.config, speculation=Speculation(tokens=mtp))
        self.engine = Engine(self.config, check_invariants=True)
        self.executor = SpansWhole(self.executor, self.engine.state)

    @rule(requests=st.lists(st.tuples(REQUEST, IMAGES), min_size=1, max_size=3))
    def arrive(self, requests: list[tuple[tuple[int, int, int, str, int, int], Any]]) -> None:  # type: ignore[override]
        for request, image in requests:
            super().arrive([request])
            self.inputs[-1] = with_image(self.inputs[-1], image)


ExternalKVMachineWithMTPAndImages.TestCase.settings = ExternalKVMachine.TestCase.settings
TestExternalKVStateMachineWithMTPAndImages = ExternalKVMachineWithMTPAndImages.TestCase


class ExternalKVMachineUnderVllm(ExternalKVMachine):
    """The same machine in the vLLM adapter's configuration with a KV connector: blocks
    cached when planned, nothing admitted in a step that preempts, and the connector saving
    on its own (``external.saver = "connector"``: kvsched orders no save), which may keep a
    sequence's blocks past its end (``KVHoldRequested``) until it releases them; attention
    models."""

    @initialize(**EXTERNAL_CONFIGS)
    def start(self, **kw) -> None:  # type: ignore[no-untyped-def]
        order = "fcfs" if kw["order"] == "ttft" else kw["order"]  # (vLLM's orders)
        super().start(**{**kw, "hybrid": False, "role": "both", "order": order})
        self.config = attrs.evolve(
            self.config,
            cache_when_planned=True,
            dedup_cached_blocks=False,
            preemption=Preemption(admit_after=False, latest_entered=True),
            external=attrs.evolve(self.config.external, saver="connector"),
        )
        self.engine = Engine(self.config, check_invariants=True)
        self.asked_holds: set[int] = set()  # holds sent, every one folded by the next step

    @rule(pick=st.integers(0, 7), blocks=st.integers(1, 8))
    def connector_holds(self, pick: int, blocks: int) -> None:
        """The connector keeps a live sequence's first blocks (before its outcome, its end
        or its abort in the same step are folded)."""
        t = self.engine.state.seqs
        live = [s for s in sorted(t.seqs) if len(t.block_table(t.seq(s)))]
        live = [s for s in live if s not in self.asked_holds]
        if live:
            seq_id = live[pick % len(live)]
            n = min(blocks, len(t.block_table(t.seq(seq_id))))
            self.inputs.append(ev.KVHoldRequested(seq_id, n))
            self.asked_holds.add(seq_id)

    @rule(pick=st.integers(0, 7))
    def connector_releases(self, pick: int) -> None:
        asked = {e.seq_id for e in self.inputs if isinstance(e, ev.KVHoldReleased)}
        held = sorted(set(self.engine.state.transfers.holds) - asked)
        if held:
            self.inputs.append(ev.KVHoldReleased(held[pick % len(held)]))

    def _in_flight(self) -> bool:
        return super()._in_flight() or bool(self.engine.state.transfers.holds)

    def teardown(self) -> None:
        if hasattr(self, "engine") and not self.failed:
            self._step()  # (the holds asked are folded; then every one is released)
            holds = sorted(self.engine.state.transfers.holds)
            self.inputs += [ev.KVHoldReleased(s) for s in holds]
        super().teardown()


ExternalKVMachineUnderVllm.TestCase.settings = ExternalKVMachine.TestCase.settings
TestExternalKVStateMachineUnderVllm = ExternalKVMachineUnderVllm.TestCase


class ExternalKVMachineUnderVllmStore(ExternalKVMachine):
    """The vLLM adapter's configuration with kvsched's own store connector
    (``KvschedConnector``): blocks cached when planned and kvsched deciding its saves, with
    hybrid states; every save reads only blocks an outcome already wrote."""

    @initialize(**EXTERNAL_CONFIGS)
    def start(self, **kw) -> None:  # type: ignore[no-untyped-def]
        order = "fcfs" if kw["order"] == "ttft" else kw["order"]  # (vLLM's orders)
        role = "decode" if kw["role"] == "decode" else "both"  # (kv_consumer, or saving)
        super().start(**{**kw, "role": role, "order": order})
        self.config = attrs.evolve(
            self.config, cache_when_planned=True, dedup_cached_blocks=False,
            preemption=Preemption(admit_after=False, latest_entered=True),
        )
        self.engine = Engine(self.config, check_invariants=True)
        self.written: set[int] = set()  # blocks whose KV an executed step or a load wrote
        self.loading: dict[int, list[int]] = {}  # seq -> the blocks its load writes
        self.loading_sync: set[int] = set()  # synchronous loads not settled yet
        self.executor = _RecordsWrites(self.executor, self.written)

    def _step(self, reports: Reports = (), **kw) -> tuple[ev.Event, ...]:  # type: ignore[no-untyped-def]
        for r in reports:  # (a load's blocks are written when it is reported)
            if isinstance(r, ev.KVLoadFinished | ev.KVLoadFailed):
                blocks = self.loading.pop(r.seq_id, [])
                good = len(blocks) if isinstance(r, ev.KVLoadFinished) else r.num_good_blocks
                self.written.update(blocks[:good])
        return super()._step(reports, **kw)

    def _check_decisions(self, reports: Reports, decisions: tuple[ev.Event, ...]) -> None:
        for d in decisions:
            if isinstance(d, ev.BlocksAllocated):
                self.written.difference_update(d.blocks.tolist())
            elif isinstance(d, ev.KVLoadStarted):
                self.loading[d.seq_id] = d.blocks.tolist()
                if d.synchronous:  # (loaded before the forward of the step that settles it)
                    self.loading_sync.add(d.seq_id)
            elif isinstance(d, ev.KVLoadSettled) and d.seq_id in self.loading_sync:
                self.loading_sync.discard(d.seq_id)
                self.written.update(self.loading.pop(d.seq_id, []))
            elif isinstance(d, ev.KVSaveStarted):
                unwritten = sorted(set(d.blocks.tolist()) - self.written)
                assert not unwritten, f"save {d.save_id} reads blocks {unwritten} not yet written"
        super()._check_decisions(reports, decisions)


class _RecordsWrites:
    """An executor that records the blocks each executed plan fills (its last position's):
    into ``written``, or (a dict) into ``written[step]``, for its outcome to land."""

    def __init__(
        self, inner: Any, written: set[int] | dict[int, set[int]], landed: set[int] | None = None
    ) -> None:
        self.inner, self.written, self.landed = inner, written, landed

    def execute(self, plan: Any) -> ev.Event:
        out = self.inner.execute(plan)
        into = self.written
        if isinstance(into, dict):
            into = into.setdefault(plan.step, set())
        for src, dst in plan.copy_blocks.tolist():
            if src in into or (self.landed is not None and src in self.landed):
                into.add(dst)
        bs = plan.block_size
        full = plan.positions % bs == bs - 1
        into.update((plan.slot_mapping[full] // bs).tolist())
        return out


ExternalKVMachineUnderVllmStore.TestCase.settings = ExternalKVMachine.TestCase.settings
TestExternalKVStateMachineUnderVllmStore = ExternalKVMachineUnderVllmStore.TestCase


# ---------------------------------------------------------------------- overlapped steps


class _Overlapped:
    """Overlapped steps (``speculation.pipelined``, vLLM's async scheduling) for a machine
    above: each step's outcome is an input of the step after next, so every step is planned
    while the one before runs, with the store's reports, faults, aborts and drains between."""

    older: list[ev.Event]  # (tests.overlapped: the outcome of the step before the latest)

    def _overlap(self) -> None:
        overlap(self)

    def _step(self, reports: Reports = (), **kw: Any) -> tuple[ev.Event, ...]:
        step = super()._step  # type: ignore[misc]
        decisions: tuple[ev.Event, ...] = step_after_next(self, lambda: step(reports, **kw))
        return decisions


class ExternalKVMachinePipelined(_Overlapped, ExternalKVMachine):
    """kvsched's own engine with external KV and overlapped steps: loads, lookups and saves
    (hybrid states too) while a step is out."""

    @initialize(**EXTERNAL_CONFIGS)
    def start(self, **kw) -> None:  # type: ignore[no-untyped-def]
        super().start(**kw)
        self._overlap()


class ExternalKVMachineUnderVllmAsync(_Overlapped, ExternalKVMachineUnderVllm):
    """The vLLM adapter's configuration with a KV connector under vLLM's async scheduling."""

    @initialize(**EXTERNAL_CONFIGS)
    def start(self, **kw) -> None:  # type: ignore[no-untyped-def]
        super().start(**kw)
        self._overlap()


class ExternalKVMachineUnderVllmStorePipelined(_Overlapped, ExternalKVMachineUnderVllmStore):
    """Blocks cached at planning, kvsched deciding its saves, overlapped steps: a save reads
    only blocks an outcome that landed wrote, not those a step still out writes (whose
    failure would leave them unwritten: a save then stores garbage under a good name). The
    executor's writes count once its outcome lands."""

    @initialize(**EXTERNAL_CONFIGS)
    def start(self, **kw) -> None:  # type: ignore[no-untyped-def]
        super().start(**kw)
        self._overlap()
        self.by_step: dict[int, set[int]] = {}  # blocks each executed step wrote, unlanded
        self.executor = _RecordsWrites(self.executor.inner, self.by_step, self.written)

    def _step(self, reports: Reports = (), **kw: Any) -> tuple[ev.Event, ...]:
        for o in self.older:  # (the outcome this step folds: _Overlapped feeds it)
            written = self.by_step.pop(o.step, set())
            if isinstance(o, ev.StepExecuted):
                self.written.update(written)
        return super()._step(reports, **kw)

    def _check_decisions(self, reports: Reports, decisions: tuple[ev.Event, ...]) -> None:
        for d in decisions:
            if isinstance(d, ev.BlocksAllocated):  # (a new owner: an older write is void)
                for pending in self.by_step.values():
                    pending.difference_update(d.blocks.tolist())
        super()._check_decisions(reports, decisions)


for _machine in (
    ExternalKVMachinePipelined,
    ExternalKVMachineUnderVllmAsync,
    ExternalKVMachineUnderVllmStorePipelined,
):
    _machine.TestCase.settings = ExternalKVMachine.TestCase.settings
TestExternalKVStateMachinePipelined = ExternalKVMachinePipelined.TestCase
TestExternalKVStateMachineUnderVllmAsync = ExternalKVMachineUnderVllmAsync.TestCase
TestExternalKVStateMachineUnderVllmStorePipelined = (
    ExternalKVMachineUnderVllmStorePipelined.TestCase
)


# ------------------------------------------------------------------------ planted bugs


def _run_broken(
    monkeypatch: pytest.MonkeyPatch, target: object, name: str, broken: object, examples: int = 150
) -> None:
    assert_machine_catches(monkeypatch, ExternalKVMachine, target, name, broken, examples)


def test_a_save_that_keeps_its_blocks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = TransferTable._on_save_finished

    def save_finished_without_release(self: TransferTable, e: ev.KVSaveFinished) -> None:
        original(self, e)  # the lease ends, but its references are never dropped

    _run_broken(monkeypatch, TransferTable, "_on_save_finished", save_finished_without_release)


def test_an_abort_that_does_not_wait_for_the_load_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def abort_at_once(self, state, seq_id, reason, emit, close_session=False):  # type: ignore[no-untyped-def]
        seq = state.seqs.seqs.get(seq_id)
        if seq is None:
            return True
        load = state.transfers.load_of(seq_id)
        if load is not None and load.open:
            emit(ev.KVLoadCancelled(seq_id, reason))
        # (loading or running: it releases its row's blocks first)
        self.growth.end(state, [seq], ev.SequenceAborted(seq_id, reason), emit)
        return True

    _run_broken(monkeypatch, Policy, "abort", abort_at_once, examples=300)


def test_a_deferred_abort_that_is_forgotten_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def settle_without_the_deferred_abort(self, state, seq_id, emit):  # type: ignore[no-untyped-def]
        load = state.transfers.load_of(seq_id)
        failed = load.state == LoadState.FAILED
        good = 0 if failed and state.hybrid else load.good_blocks
        emit(ev.KVLoadSettled(seq_id, load.first_block + good))
        seq = state.seq(seq_id)
        self.growth.cache_computed(state, emit, np.asarray([seq.row]))
        if failed and state.hybrid:
            self.preempt(state, seq, emit, "kv load failed")

    _run_broken(monkeypatch, Policy, "settle_load", settle_without_the_deferred_abort)


def _loaded_blocks_only(self, state, seq, first):  # type: ignore[no-untyped-def]
    """A soft load admission that makes room only for the blocks it loads into."""
    if not self.config.soft_loads:
        return -(-seq.n_tokens // self.bs) - first  # (it takes every prompt block)
    return state.transfers.load_of(seq.seq_id).num_blocks - first


def test_a_load_admission_making_room_only_for_what_it_loads_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _run_broken(monkeypatch, Transfers, "load_need", _loaded_blocks_only, examples=600)


def test_without_the_fit_invariant_the_teardown_finds_loads_waiting_on_each_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tail deadlock itself: loads holding their loaded blocks, with nothing reserved for
    the rest of their prompts, fill the cache; then none can take a block for its tail and
    the teardown (a prompt store, no new work) reports the livelock."""
    monkeypatch.setattr(Transfers, "load_need", _loaded_blocks_only)
    planted = settings(
        max_examples=600,
        stateful_step_count=30,
        deadline=None,
        database=None,
        derandomize=True,
        print_blob=False,
        phases=[Phase.generate],
    )
    with pytest.raises(AssertionError, match="livelock"):
        run_state_machine_as_test(_WithoutTheFitCheck, settings=planted)


class _WithoutTheFitCheck(ExternalKVMachine):
    def admitted_loads_fit_the_cache_together(self) -> None:  # (not an invariant here)
        return None


def test_a_load_admission_ignoring_other_loads_reservations_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _run_broken(monkeypatch, Transfers, "soft_reserved", lambda self, state: 0, examples=600)


def test_a_failed_load_that_is_forgotten_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = TransferTable._forget

    def forget_failed_too(self: TransferTable, seq_id: int, keep_failed: bool = False) -> None:
        original(self, seq_id, keep_failed=False)

    _run_broken(monkeypatch, TransferTable, "_forget", forget_failed_too)


# ------------------------------------------------------- regressions the machine found


class _Node(Harness):
    """An engine and a simulated executor, stepped by hand (the store is the test)."""

    def __init__(self, **overrides: object) -> None:
        base: dict[str, object] = {
            "model": ModelSpec(vocab_size=VOCAB, max_context=128),
            "block_size": 4,
            "num_blocks": 12,
            "max_batch": 1,
            "max_prefill_tokens": 4,
            "external_kv": True,
        }
        super().__init__(**{**base, **overrides})

    def step(self, *inputs: ev.Event) -> list[ev.Event]:  # type: ignore[override]
        return list(super().step(inputs).decisions[1:])

    def owed(self) -> list[ev.Event]:
        """Everything a prompt store owes: lookups answered in full, loads and saves done."""
        out: list[ev.Event] = []
        for seq_id, load in sorted(self.engine.state.transfers.loads.items()):
            if load.state == LoadState.LOOKUP_PENDING:
                out.append(ev.KVLookupAnswered(seq_id, load.num_blocks))
            elif load.in_flight:
                out.append(ev.KVLoadFinished(seq_id))
        return out + [ev.KVSaveFinished(s) for s in sorted(self.engine.state.transfers.leases)]

    def lookup_range(self, seq_id: int) -> tuple[int, int]:
        load = self.engine.state.transfers.load_of(seq_id)
        assert load is not None and load.state == LoadState.LOOKUP_PENDING
        return load.first_block, load.num_blocks


def _tokens(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def test_a_save_in_flight_keeps_the_cached_prefix_closed() -> None:
    """A save leases only the blocks it reads, not their prefix: once the sequence is gone
    the cached parent can be evicted while its leased child stays registered (the prefix
    index is no longer prefix-closed: BlockPoolError 'cached but its parent is not')."""
    node = _Node(num_blocks=6)
    node.step(ev.RequestArrived(0, _tokens(1, 8), 1))  # lookup of chain block [0, 1)
    node.step(ev.KVLookupAnswered(0, 0))  # a miss: computed here, 4 tokens a step
    node.step()  # save 0: chain block 0
    node.step()  # save 1: chain block 1; the sequence finishes (both blocks cached)
    node.step(ev.KVSaveFinished(0), ev.RequestArrived(1, _tokens(20, 16), 1))
    node.step(ev.KVLookupAnswered(1, 0))
    for _ in range(4):
        node.step()  # the fourth block of request 1 evicts chain block 0 (save 1 holds 1)


def test_a_wake_while_a_drain_waits_for_a_load_is_not_lost() -> None:
    """Drain (deferred: a load flies), then wake, then the load settles: the wake cancelled
    the waiting drain, so the engine is awake and serves its work (it once fell asleep
    after the wake, with work waiting)."""
    node = _Node()
    node.step(ev.RequestArrived(0, _tokens(1, 12), 4))
    node.step(ev.KVLookupAnswered(0, 2))  # admitted to load chain blocks [0, 2)
    assert any(isinstance(d, ev.DrainDeferred) for d in node.step(ev.DrainRequested()))
    node.step(ev.WakeRequested())
    node.step(ev.KVLoadFinished(0))
    for _ in range(20):
        node.step(*node.owed())
    assert not node.engine.state.sleeping, "asleep, though the latest request was to wake"
    assert not node.engine.has_work


def test_a_hybrid_load_admission_evicts_checkpoints_to_fit() -> None:
    """A hybrid load admission whose local part is cached but unheld: ``_make_fit`` asks
    ``_evict_checkpoints_for`` for ``need`` blocks, which counts those unheld hit blocks as
    available, so it evicts nothing, the admission does not fit, and (nothing else running)
    the engine livelocks. The hypothesis-printed steps, shrunk."""
    machine = ExternalKVMachine()
    machine.start(
        hybrid=True,
        role="both",
        num_blocks=12,
        max_batch=1,
        chunk_blocks=1,
        decode_interval=4,
        budget=1,
        turn_mode="mixed",
        order="fcfs",
    )
    same = (1, 0, 1, "", 0, -1)  # 20 tokens
    machine.arrive(requests=[same, (1, 0, 9, "lora-a", 0, -1), same])
    machine.teardown()  # a prompt store: answers, loads and saves at once


def test_a_session_turn_in_another_namespace_is_admitted_to_load() -> None:
    """A session's next turn under another adapter, all of it in the store: the whole-prompt
    load admission needs blocks that only the session's own hold can give (useless to it:
    another namespace; the admission frees it anyway), but ``_make_fit`` never counts that
    hold as reclaimable, so the turn is never admitted (livelock)."""
    node = _Node(max_prefill_tokens=8)
    node.step(ev.RequestArrived(0, _tokens(1, 20), 1, session_id=0, adapter="lora-a"))
    node.step(ev.KVLookupAnswered(0, 0))
    for _ in range(3):
        node.step()
    node.step(*node.owed())
    assert len(node.engine.state.sessions[0].held) == 5
    node.step(ev.RequestArrived(1, _tokens(30, 8), 1, session_id=0))
    _, end = node.lookup_range(1)
    node.step(ev.KVLookupAnswered(1, end))  # the store holds every block
    for _ in range(20):
        node.step(*node.owed())
    assert 1 not in node.engine.state.seqs.seqs, "the turn was never admitted"


def test_partial_checkpoints_with_one_anchor_and_length_coexist() -> None:
    """Not external KV: two published partial checkpoints with the same anchor and length
    but different tail tokens share one ``CheckpointTable.partials[anchor][step]`` entry;
    evicting or releasing one drops the other's entry, and releasing that one then raises
    KeyError. Request 0's tail is [5, 5, sampled token] after a preemption (the drain),
    request 1's is [5, 5, 5]."""
    node = _Node(
        external_kv=False, hybrid=True, num_blocks=16, max_prefill_tokens=32, checkpoint_budget=4
    )
    prefix = _tokens(1, 20)
    node.step(ev.RequestArrived(0, np.append(prefix, [5, 5]).astype(np.int32), 2))
    node.step(ev.DrainRequested())  # preempted after its first token
    node.step(ev.WakeRequested())  # recomputed: partial checkpoint at 23 tokens
    node.step()
    node.step(ev.RequestArrived(1, np.append(prefix, [5, 5, 5]).astype(np.int32), 1))
    node.step()
    node.step()
    assert any(isinstance(d, ev.Drained) for d in node.step(ev.DrainRequested()))


def test_a_connector_hold_that_takes_no_block_references_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hold whose blocks are not referenced would let the sequence's end free blocks the
    connector still reads."""
    original = TransferTable._on_hold_requested

    def hold_without_references(self: TransferTable, e: ev.KVHoldRequested) -> None:
        original(self, e)  # the hold is recorded, its references never taken

    assert_machine_catches(
        monkeypatch, ExternalKVMachineUnderVllm, TransferTable, "_on_hold_requested",
        hold_without_references, 150,
    )


def test_a_prefill_turn_that_admits_under_blocks_cached_when_planned_does_not_decode_too():
    """Shrunk by the deep profile (alternate turns, blocks cached when planned: each chunk
    emitted on its own, so the step's list of chunks stays empty): the prefill turn also
    scheduled the running decodes, whose growth preempted the sequence it had just admitted
    and left that row's chunk in the plan (``sequence -1 is not live``)."""
    machine = ExternalKVMachineUnderVllm()
    machine.start(
        hybrid=False, role="both", num_blocks=12, max_batch=4, chunk_blocks=3,
        decode_interval=0, budget=1, turn_mode="alternate", order="fcfs", load_admission="soft",
    )  # fmt: skip
    machine.arrive(requests=[(0, 0, 1, "", 0, -1), (0, 0, 5, "", 0, -1), (1, 0, 2, "", 0, -1)])
    machine.load_burst(depth=1, n=2, ok=False, prefix=0, synchronous=False, sync_loads=False)
    machine.run_steps(n=1, store="silent")
    machine.teardown()


def test_a_save_of_blocks_a_step_still_out_writes_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Overlapped steps with blocks cached at planning: a save that reads every indexed
    block (not only those a landed outcome wrote) reads KV a step still out writes."""

    def every_indexed_block(self: PipelinedRows, rows: np.ndarray) -> np.ndarray:
        return self.registered[rows]  # type: ignore[no-any-return]

    assert_machine_catches(
        monkeypatch,
        ExternalKVMachineUnderVllmStorePipelined,
        PipelinedRows,
        "written_blocks",
        every_indexed_block,
    )
