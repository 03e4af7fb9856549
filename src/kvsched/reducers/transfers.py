"""TransferTable: external-KV loads (one per sequence) and save leases.

A load record follows the KVLoad machine: LOOKUP_PENDING (the store is being asked) ->
PLANNED (the store holds ``[first_block, num_blocks)``) -> ADMITTED -> ALLOCATED -> LOADING ->
READY | FAILED; or CANCELLED. Records of terminal loads stay until the sequence leaves its row
(a FAILED record survives a preemption, so the sequence does not try the store again). A
load that ended waits to be settled (``KVLoadSettled``): at once when it holds a batch row,
when it is admitted into one when it holds none (``ready_loads``). The blocks a load without
a row holds are ``LoadHoldings``', not this table's.

A lease is what a save in flight holds: one pool reference on each block of the sequence's
prefix up to the last block it saves (not only the blocks it reads: a cached block never
outlives its parent, so the prefix index stays prefix-closed) and, for a hybrid model, one
pin on the checkpoint whose state it reads. Leases end with
``KVSaveFinished`` (confirmed or failed); until then the blocks cannot be reused, so a
finished sequence's blocks outlive it exactly as long as its saves.

The table folds the transfer events and reads the sequence table (a load's destination
blocks, a lease's prefix); the references a lease takes or drops are returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from kvsched.events import types as ev
from kvsched.reducers.errors import RefChange, ReplayMismatch
from kvsched.reducers.seq import FREE_ROW
from kvsched.reducers.sequences import SequenceTable
from kvsched.statemachines import (
    KVLOAD,
    KVSAVE,
    LoadState,
    SaveState,
    SeqState,
    fire,
)

_NO_BLOCKS = np.zeros(0, dtype=np.int32)
_ADMITTED = (
    LoadState.ADMITTED, LoadState.ALLOCATED, LoadState.LOADING, LoadState.READY, LoadState.FAILED
)


@attrs.define(slots=True, eq=False)
class KVLoad:
    seq_id: int
    state: LoadState
    first_block: int  # chain blocks the engine had (or attached) itself
    num_blocks: int  # end of the chain range: asked for, then available, then admitted
    with_state: bool = False
    blocks: np.ndarray = _NO_BLOCKS  # destinations of [first_block, num_blocks)
    abort_reason: str = ""  # a deferred abort, applied when the load settles
    close_session: bool = False  # the deferred abort came from an end of session
    failure: str = ""
    good_blocks: int = 0  # a failed load: its leading blocks written completely
    sync: bool = False  # the store's answer: its load runs within the step that starts it
    settled: bool = False  # the sequence runs (KVLoadSettled)
    # Its sequence left after the load failed: the record only keeps the store from being
    # asked again (it holds and reserves nothing).
    retired: bool = False

    def fire(self, event: ev.Event) -> None:
        """Fire the trigger ``event`` fires on a load (statemachines/triggers.py)."""
        self.state = fire(KVLOAD, event, self.seq_id, self.state, context=self.first_block)

    @property
    def in_flight(self) -> bool:
        return self.state == LoadState.LOADING

    @property
    def open(self) -> bool:
        """Looked up or planned, not yet admitted: a waiting sequence's pending work."""
        return self.state in (LoadState.LOOKUP_PENDING, LoadState.PLANNED)

    @property
    def ended(self) -> bool:
        """The transfer finished or failed, and the sequence still waits for the policy to
        settle it (KVLoadSettled)."""
        done = self.state in (LoadState.READY, LoadState.FAILED)
        return done and not (self.settled or self.retired)

    @property
    def admitted(self) -> bool:
        """Admitted, and its sequence has not left since: it holds blocks (or a row)."""
        return self.state in _ADMITTED and not self.retired


@attrs.define(slots=True, eq=False)
class Lease:
    """A save in flight (KVSave machine: PENDING -> SAVING at its start, then SAVED or
    FAILED when the store's answer is folded, and the lease ends)."""

    save_id: int
    seq_id: int
    blocks: np.ndarray  # referenced: the prefix up to the last saved block
    num_saved: int  # the trailing blocks being saved
    ckpt_id: int = -1
    state: SaveState = SaveState.PENDING

    def fire(self, event: ev.Event) -> None:
        self.state = fire(KVSAVE, event, self.save_id, self.state)


class TransferTable:
    def __init__(self, seqs: SequenceTable) -> None:
        self._seqs = seqs
        self.loads: dict[int, KVLoad] = {}
        self.leases: dict[int, Lease] = {}
        # A serving engine's connector saving a sequence on its own (KVHoldRequested): a
        # lease by sequence id, on its blocks as they were, until KVHoldReleased.
        self.holds: dict[int, Lease] = {}
        self.next_save_id = 0
        self.loaded_blocks = 0  # statistics: blocks loaded successfully
        self.failed_loads = 0
        self.saved_blocks = 0  # statistics: blocks whose save the store confirmed
        self.failed_saves = 0

    def folds(self) -> dict[type[ev.Event], Callable[[Any], RefChange | None]]:
        return {
            ev.KVLookupStarted: self._on_lookup_started,
            ev.KVLookupAnswered: self._on_lookup_answered,
            ev.KVLoadCancelled: self._on_load_cancelled,
            ev.KVLoadAdmitted: self._on_load_admitted,
            ev.BlocksAllocated: self._on_allocated,
            ev.KVLoadStarted: self._on_load_started,
            ev.KVLoadFinished: self._on_load_finished,
            ev.KVLoadFailed: self._on_load_failed,
            ev.KVLoadSettled: self._on_load_settled,
            ev.AbortDeferred: self._on_abort_deferred,
            ev.SequencePreempted: self._on_preempted,
            ev.SequenceFinished: self._on_finished,
            ev.SequenceAborted: self._on_aborted,
            ev.KVSaveStarted: self._on_save_started,
            ev.KVSaveFinished: self._on_save_finished,
            ev.KVHoldRequested: self._on_hold_requested,
            ev.KVHoldReleased: self._on_hold_released,
            ev.Drained: self._on_drained,
        }

    # ------------------------------------------------------------------------- queries

    @property
    def busy(self) -> bool:
        """A load or a save is in flight (or a load ended and is not settled yet)."""
        loads = self.loads.values()
        return bool(self.leases or self.holds) or any(ld.in_flight or ld.ended for ld in loads)

    @property
    def transferring(self) -> bool:
        """A load or a save is in flight: device memory is being written or read."""
        return bool(self.leases or self.holds) or any(ld.in_flight for ld in self.loads.values())

    def ready_loads(self) -> list[int]:
        """Sequences whose load ended and that wait to be settled into a batch row."""
        return sorted(s for s, ld in self.loads.items() if ld.ended)

    def loads_by_seq(self) -> list[tuple[int, KVLoad]]:
        """(sequence id, load record) of every load, in the order they started."""
        return list(self.loads.items())

    def load_of(self, seq_id: int) -> KVLoad | None:
        return self.loads.get(seq_id)

    def in_flight_loads(self) -> list[int]:
        return sorted(s for s, ld in self.loads.items() if ld.in_flight)

    def lease_holders(self) -> list[np.ndarray]:
        leases = [*self.leases.values(), *self.holds.values()]
        return [lease.blocks for lease in leases if len(lease.blocks)]

    def lease_pins(self) -> dict[int, int]:
        pins: dict[int, int] = {}
        for lease in self.leases.values():
            if lease.ckpt_id >= 0:
                pins[lease.ckpt_id] = pins.get(lease.ckpt_id, 0) + 1
        return pins

    # -------------------------------------------------------------------------- folds

    def _load(self, seq_id: int) -> KVLoad:
        load = self.loads.get(seq_id)
        if load is None:
            raise ReplayMismatch(f"sequence {seq_id} has no KV load")
        return load

    def _on_lookup_started(self, e: ev.KVLookupStarted) -> None:
        seq = self._seqs.seqs.get(e.seq_id)
        if seq is None or seq.state != SeqState.WAITING or e.seq_id in self.loads:
            raise ReplayMismatch(f"lookup for sequence {e.seq_id}, which cannot look up")
        self.loads[e.seq_id] = KVLoad(
            e.seq_id, LoadState.LOOKUP_PENDING, e.first_block, e.num_blocks, e.with_state
        )
        if e.answer >= 0:  # (answered within the step: as its answer would be folded)
            self._on_lookup_answered(ev.KVLookupAnswered(e.seq_id, e.answer, sync_load=e.sync_load))

    def _on_lookup_answered(self, e: ev.KVLookupAnswered) -> None:
        """An input (or a lookup's answer within its step): a stale answer (its lookup was
        cancelled meanwhile) is ignored; an answer larger than the lookup asked counts only
        the asked range."""
        load = self.loads.get(e.seq_id)
        if load is None or load.state != LoadState.LOOKUP_PENDING:
            return
        load.fire(e)  # (pending, a hit or a miss: triggers.py selects)
        if not e.pending and e.num_blocks > load.first_block:  # a hit
            load.num_blocks = min(e.num_blocks, load.num_blocks)
            load.sync = e.sync_load

    def _on_load_cancelled(self, e: ev.KVLoadCancelled) -> None:
        load = self._load(e.seq_id)
        load.fire(e)
        del self.loads[e.seq_id]  # a waiting sequence may look up again later

    def _on_load_admitted(self, e: ev.KVLoadAdmitted) -> None:
        load = self._load(e.seq_id)
        load.fire(e)
        load.first_block, load.num_blocks = e.first_block, e.num_blocks

    def _on_allocated(self, e: ev.BlocksAllocated) -> None:
        if not self.loads:
            return
        for seq_id in e.seq_ids.tolist():
            load = self.loads.get(seq_id)
            if load is not None and load.state == LoadState.ADMITTED:
                load.fire(e)

    def _on_load_started(self, e: ev.KVLoadStarted) -> None:
        load = self._load(e.seq_id)
        seq = self._seqs.seq(e.seq_id)
        lo, hi = load.first_block, load.num_blocks
        held = self._seqs.block_table(seq)[lo:hi]
        if e.first_block != lo or not np.array_equal(held, e.blocks):
            raise ReplayMismatch(f"sequence {e.seq_id}: load into blocks it does not hold")
        if e.synchronous and not load.sync:
            raise ReplayMismatch(f"sequence {e.seq_id}: a synchronous load its store did not offer")
        load.fire(e)
        load.blocks = np.array(e.blocks, dtype=np.int32)
        if e.synchronous:  # (it ends within its step: the executor loads before the forward)
            self._on_load_finished(ev.KVLoadFinished(e.seq_id))

    def _on_load_finished(self, e: ev.KVLoadFinished) -> None:
        load = self._load(e.seq_id)
        load.fire(e)
        load.good_blocks = len(load.blocks)

    def _on_load_failed(self, e: ev.KVLoadFailed) -> None:
        load = self._load(e.seq_id)
        load.fire(e)
        load.good_blocks = max(0, min(e.num_good_blocks, len(load.blocks)))
        load.failure = e.reason
        self.failed_loads += 1

    def _on_load_settled(self, e: ev.KVLoadSettled) -> None:
        load = self._load(e.seq_id)
        good = e.num_blocks - load.first_block
        if not load.ended or not 0 <= good <= load.good_blocks:
            raise ReplayMismatch(f"sequence {e.seq_id}: load settled at {e.num_blocks} blocks")
        load.settled = True
        self.loaded_blocks += good

    def _on_abort_deferred(self, e: ev.AbortDeferred) -> None:
        load = self._load(e.seq_id)
        adds_close = e.close_session and not load.close_session
        if not load.in_flight or (load.abort_reason and not adds_close):
            raise ReplayMismatch(f"sequence {e.seq_id}: abort deferred twice or without a load")
        load.abort_reason = load.abort_reason or e.reason
        load.close_session = load.close_session or e.close_session

    def _forget(self, seq_id: int, keep_failed: bool = False) -> None:
        """The sequence left its row (or the engine), or a load without a row was dropped
        after its transfer ended: drop its record (a FAILED one is kept on request, so a
        preempted sequence does not retry a store that failed it)."""
        load = self.loads.get(seq_id)
        if load is None:
            return
        if load.in_flight:
            raise ReplayMismatch(f"sequence {seq_id} left while its load is {load.state.name}")
        if keep_failed and load.state == LoadState.FAILED:
            load.retired = True
            return
        del self.loads[seq_id]

    def _on_preempted(self, e: ev.SequencePreempted) -> None:
        self._forget(e.seq_id, keep_failed=True)

    def _on_finished(self, e: ev.SequenceFinished) -> None:
        for seq_id in e.seq_ids.tolist():
            self._forget(seq_id)

    def _on_aborted(self, e: ev.SequenceAborted) -> None:
        load = self.loads.get(e.seq_id)
        if load is not None and load.open:
            raise ReplayMismatch(f"sequence {e.seq_id} aborted with its load {load.state.name}")
        self._forget(e.seq_id)

    def _on_save_started(self, e: ev.KVSaveStarted) -> RefChange:
        seq = self._seqs.seq(e.seq_id)
        t, row, hi = self._seqs, seq.row, e.first_block + len(e.blocks)
        if row == FREE_ROW or hi > t.registered[row]:
            raise ReplayMismatch(f"save {e.save_id}: blocks of {e.seq_id} are not computed")
        held = t.path_blocks(seq, 0, hi)  # (an MTP private copy's cached block instead)
        if not np.array_equal(held[e.first_block :], e.blocks):
            raise ReplayMismatch(f"save {e.save_id}: blocks not held by sequence {e.seq_id}")
        if e.save_id != self.next_save_id:
            raise ReplayMismatch(f"save id {e.save_id}, expected {self.next_save_id}")
        # The lease holds the whole prefix up to the saved blocks, not only them: a cached
        # block must never outlive its parent (the prefix index stays prefix-closed).
        lease = Lease(e.save_id, e.seq_id, held, len(e.blocks), e.ckpt_id)
        lease.fire(e)
        self.leases[e.save_id] = lease
        self.next_save_id += 1
        return RefChange(attach=(held,))

    def _on_save_finished(self, e: ev.KVSaveFinished) -> RefChange:
        """The store answered a save: the lease ends."""
        lease = self.leases.pop(e.save_id, None)
        if lease is None:
            raise ReplayMismatch(f"save {e.save_id} finished but was never started")
        lease.fire(e)
        if e.ok:
            self.saved_blocks += lease.num_saved
        else:
            self.failed_saves += 1
        return RefChange(release=(lease.blocks,))

    def _on_hold_requested(self, e: ev.KVHoldRequested) -> RefChange:
        """(checked as an input: the sequence is live, holds that many blocks, once)"""
        held = self._seqs.block_table(self._seqs.seq(e.seq_id))[: e.num_blocks].copy()
        lease = Lease(-1, e.seq_id, held, len(held))
        lease.fire(e)
        self.holds[e.seq_id] = lease
        return RefChange(attach=(held,))

    def _on_hold_released(self, e: ev.KVHoldReleased) -> RefChange:
        lease = self.holds.pop(e.seq_id)
        lease.fire(e)
        return RefChange(release=(lease.blocks,))

    def _on_drained(self, e: ev.Drained) -> None:
        if self.busy:
            raise ReplayMismatch("drained while KV transfers are in flight")

    def check_invariants(self, loading_seqs: set[int]) -> str | None:
        """``loading_seqs``: the sequences in LOADING_KV. None when consistent."""
        flying = {s for s, ld in self.loads.items() if ld.in_flight or ld.ended}
        if flying != loading_seqs:
            return f"loads in flight {sorted(flying)} but sequences loading {sorted(loading_seqs)}"
        for load in self.loads.values():
            if not 0 <= load.first_block <= load.num_blocks:
                return f"load of {load.seq_id}: range [{load.first_block}, {load.num_blocks})"
            if (load.in_flight or load.ended) and len(load.blocks) != (
                load.num_blocks - load.first_block
            ):
                return f"load of {load.seq_id}: {len(load.blocks)} destination blocks"
            if load.retired and load.state != LoadState.FAILED:
                return f"load of {load.seq_id}: retired in state {load.state.name}"
        for save_id, lease in self.leases.items():
            if save_id >= self.next_save_id or lease.save_id != save_id:
                return f"lease of save {save_id} is not a started save"
            if lease.state != SaveState.SAVING:
                return f"lease of save {save_id} in state {lease.state.name}"
        for seq_id, hold in self.holds.items():
            if hold.seq_id != seq_id or hold.state != SaveState.SAVING:
                return f"hold of sequence {seq_id} in state {hold.state.name}"
        return None

    def snapshot(self) -> tuple[object, ...]:
        loads = tuple(
            (k, ld.state, ld.first_block, ld.num_blocks, ld.blocks.tobytes(), ld.abort_reason,
             ld.close_session, ld.good_blocks, ld.settled, ld.retired)
            for k, ld in sorted(self.loads.items())
        )
        leases = tuple(
            (k, ls.seq_id, ls.blocks.tobytes(), ls.ckpt_id, ls.state)
            for k, ls in sorted(self.leases.items())
        )
        holds = tuple((k, h.blocks.tobytes(), h.state) for k, h in sorted(self.holds.items()))
        return (loads, leases, holds, self.next_save_id, self.loaded_blocks, self.failed_loads,
                self.saved_blocks, self.failed_saves)
