"""ExternalKV: the driver-side bridge between the engine and an external KV store.

The engine decides (``KVLookupStarted``, ``KVLoadStarted``, ``KVSaveStarted``,
``KVLoadCancelled``); this bridge carries those decisions to the scheduler-side connector and
the worker-side transfer engine, and turns their answers into the engine's next inputs
(``KVLookupAnswered``, ``KVLoadFinished`` / ``KVLoadFailed``, ``KVSaveFinished``). Nothing in
the engine touches the store, so a run's event log replays without one.

Order inside a driver step: ``inputs()`` -> ``engine.step`` -> executor runs the plan ->
``after_step(result)``. Transfers start after the plan ran: a save reads blocks the forward
just wrote, and a load may overwrite a state slot the plan zeroed for its row.

``synchronous=True`` (the default for simulations) answers lookups at once and waits for
every transfer before the next step, so the step at which each report arrives, and therefore
the event log, is deterministic. ``synchronous=False`` is the serving mode: lookups run on a
thread (answered ``PENDING`` meanwhile) and reports arrive whenever the transfers end.
"""

from __future__ import annotations

import time
from typing import Protocol

from kvsched.connectors.keys import block_key, state_key
from kvsched.connectors.protocol import (
    PENDING,
    LookupRequest,
    SaveOrder,
    StepTransfers,
    TransferReport,
    report_events,
)
from kvsched.connectors.scheduler import StoreConnector
from kvsched.events import types as ev

__all__ = ["ChainSource", "ExternalKV", "Worker"]


class ChainSource(Protocol):
    """What the bridge asks the engine: a live sequence's namespace root and hash chain."""

    def chain(self, seq_id: int) -> tuple[bytes, tuple[bytes, ...]]: ...

    def transfers_in_flight(self) -> tuple[list[int], list[int]]: ...


class Worker(Protocol):
    """The worker-side transfer engine (``connectors.TransferEngine``)."""

    def apply(self, transfers: StepTransfers) -> None: ...

    def poll(self) -> TransferReport: ...

    def wait_idle(self, timeout_s: float = 10.0) -> bool: ...

    @property
    def num_active(self) -> int: ...


class ExternalKV:
    def __init__(
        self,
        connector: StoreConnector,
        worker: Worker,
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

    def after_step(self, engine: ChainSource, decisions: tuple[ev.Event, ...]) -> None:
        """Carry a step's transfer decisions out: start lookups, bind and start loads, start
        saves (call it after the step's plan ran)."""
        saves: list[SaveOrder] = []
        for d in decisions:
            if isinstance(d, ev.KVLookupStarted):
                self._start_lookup(engine, d)
            elif isinstance(d, ev.KVLoadCancelled):
                self._asked.pop(d.seq_id, None)
                self.connector.cancel_lookup(d.seq_id)
            elif isinstance(d, ev.KVLoadStarted):
                self.connector.bind(d.seq_id, d.blocks.tolist(), d.first_block)
                if d.state_slot >= 0:
                    self.connector.set_state_slot(d.seq_id, d.state_slot)
                self.loads_started += 1
            elif isinstance(d, ev.KVSaveStarted):
                saves.append(_save_order(engine, d))
        transfers = StepTransfers(self.connector.take_loads(), tuple(saves))
        self.saves_started += len(saves)
        if not transfers.is_empty:
            self.worker.apply(transfers)
            if self.synchronous:
                # A transfer still running at the timeout is reported failed by the worker
                # at its own deadline, so a stuck store cannot stall the run for longer.
                self.worker.wait_idle(self.wait_timeout_s)

    def _start_lookup(self, engine: ChainSource, d: ev.KVLookupStarted) -> None:
        root, hashes = engine.chain(d.seq_id)
        request = LookupRequest(
            seq_id=d.seq_id,
            namespace_root=root,
            block_hashes=hashes[: d.num_blocks],
            num_computed_blocks=d.first_block,
            with_state=d.with_state,
        )
        self._asked[d.seq_id] = request
        self.connector.lookup(request)  # starts the probe (answers at once if synchronous)
        self.lookups += 1

    def wait(self, timeout_s: float = 0.001) -> None:
        """Idle the caller briefly while only transfers are outstanding (serving mode)."""
        if self.busy:
            time.sleep(timeout_s)

    @staticmethod
    def recovered_inputs(engine: ChainSource) -> list[ev.Event]:
        """After a crash the transfers in flight are lost: report them failed, so a recovered
        engine recomputes those prefixes and releases the leases."""
        loads, saves = engine.transfers_in_flight()
        out: list[ev.Event] = [ev.KVLoadFailed(s, 0, "engine restarted") for s in loads]
        out += [ev.KVSaveFinished(s, ok=False) for s in saves]
        return out


def _save_order(engine: ChainSource, d: ev.KVSaveStarted) -> SaveOrder:
    root, hashes = engine.chain(d.seq_id)
    end = d.first_block + len(d.blocks)
    keys = tuple(block_key(root, h) for h in hashes[d.first_block : end])
    state = state_key(root, hashes[end - 1]) if d.ckpt_id >= 0 else None
    return SaveOrder(
        save_id=d.save_id,
        seq_id=d.seq_id,
        keys=keys,
        block_ids=tuple(int(b) for b in d.blocks),
        state_key=state,
        state_slot=d.state_slot,
    )
