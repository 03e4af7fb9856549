"""ExternalKV: the driver-side bridge between the engine and an external KV store.

The engine decides (``KVLookupStarted``, ``KVLoadStarted``, ``KVSaveStarted``,
``KVLoadCancelled``), and each decision carries its store keys' ingredients; this bridge
carries the decisions to the scheduler-side connector (lookups) and the worker-side transfer
engine (loads and saves: ``LoadOrder.from_event``, ``SaveOrder.from_event``), and turns their
answers into the engine's next inputs (``KVLookupAnswered``, ``KVLoadFinished`` /
``KVLoadFailed``, ``KVSaveFinished``). It reads nothing but the events: nothing in the
engine touches the store, so a run's event log replays without one.

Order inside a driver step: ``inputs()`` -> ``engine.step`` -> executor runs the plan ->
``after_step(result.decisions)``. Transfers start after the plan ran: a save reads blocks the
forward just wrote, and a load may overwrite a state slot the plan zeroed for its row.

``synchronous=True`` (the default for simulations) answers lookups at once and waits for
every transfer before the next step, so the step at which each report arrives, and therefore
the event log, is deterministic. ``synchronous=False`` is the serving mode: lookups run on a
thread (answered ``PENDING`` meanwhile) and reports arrive whenever the transfers end.
"""

from __future__ import annotations

import time
from typing import Protocol

from kvsched.connectors.protocol import (
    PENDING,
    LoadOrder,
    LookupRequest,
    SaveOrder,
    SchedulerConnector,
    StepTransfers,
    WorkerConnector,
    report_events,
)
from kvsched.events import types as ev

__all__ = ["ExternalKV", "InFlight"]


class InFlight(Protocol):
    """What a recovered engine says is in flight (``Engine.transfers_in_flight``)."""

    def transfers_in_flight(self) -> tuple[list[int], list[int]]: ...


class ExternalKV:
    def __init__(
        self,
        connector: SchedulerConnector,
        worker: WorkerConnector,
        *,
        synchronous: bool = True,
        wait_timeout_s: float = 60.0,
    ) -> None:
        self.connector = connector
        self.worker = worker
        self.synchronous = synchronous
        self.wait_timeout_s = wait_timeout_s
        self._asked: dict[int, LookupRequest] = {}
        self.lookups = 0
        self.loads_started = 0
        self.saves_started = 0

    @property
    def busy(self) -> bool:
        """Lookups unanswered or transfers running."""
        return bool(self._asked) or self.worker.num_active > 0

    def inputs(self) -> list[ev.Event]:
        """The answers and reports that arrived since the previous step, as engine inputs
        (deterministic order: lookups by sequence id, then the report's order)."""
        out: list[ev.Event] = []
        for seq_id in sorted(self._asked):
            answer = self.connector.lookup(self._asked[seq_id])
            if answer is not PENDING:
                out.append(ev.KVLookupAnswered(seq_id, answer.num_blocks))
                del self._asked[seq_id]
        out.extend(report_events(self.worker.poll()))
        return out

    def after_step(self, decisions: tuple[ev.Event, ...]) -> None:
        """Carry a step's transfer decisions out: start lookups, loads and saves (call it
        after the step's plan ran)."""
        loads: list[LoadOrder] = []
        saves: list[SaveOrder] = []
        for d in decisions:
            if isinstance(d, ev.KVLookupStarted):
                request = LookupRequest.from_event(d)
                self._asked[d.seq_id] = request
                self.connector.lookup(request)  # starts the probe (at once if synchronous)
                self.lookups += 1
            elif isinstance(d, ev.KVLoadCancelled):
                self._asked.pop(d.seq_id, None)
                self.connector.cancel_lookup(d.seq_id)
            elif isinstance(d, ev.KVLoadStarted):
                self._asked.pop(d.seq_id, None)
                self.connector.cancel_lookup(d.seq_id)  # its answer is consumed
                loads.append(LoadOrder.from_event(d))
            elif isinstance(d, ev.KVSaveStarted):
                saves.append(SaveOrder.from_event(d))
        transfers = StepTransfers(tuple(loads), tuple(saves))
        self.loads_started += len(loads)
        self.saves_started += len(saves)
        if not transfers.is_empty:
            self.worker.apply(transfers)
            if self.synchronous:
                # A transfer still running at the timeout is reported failed by the worker
                # at its own deadline, so a stuck store cannot stall the run for longer.
                self.worker.wait_idle(self.wait_timeout_s)

    def wait(self, timeout_s: float = 0.001) -> None:
        """Idle the caller briefly while only transfers are outstanding (serving mode)."""
        if self.busy:
            time.sleep(timeout_s)

    @staticmethod
    def recovered_inputs(engine: InFlight) -> list[ev.Event]:
        """After a crash the transfers in flight are lost: report them failed, so a recovered
        engine recomputes those prefixes and releases the leases."""
        loads, saves = engine.transfers_in_flight()
        out: list[ev.Event] = [ev.KVLoadFailed(s, 0, "engine restarted") for s in loads]
        out += [ev.KVSaveFinished(s, ok=False) for s in saves]
        return out
