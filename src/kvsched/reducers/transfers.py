"""TransferTable: external-KV loads (one per sequence) and save leases.

A load record follows the KVLoad machine: LOOKUP_PENDING (the store is being asked) ->
PLANNED (the store holds ``[first_block, num_blocks)``) -> ADMITTED -> ALLOCATED -> LOADING ->
READY | FAILED; or CANCELLED. Records of terminal loads stay until the sequence leaves its row
(a FAILED record survives a preemption, so the sequence does not try the store again).

A lease is what a save in flight holds: one pool reference on each block of the sequence's
prefix up to the last block it saves (not only the blocks it reads: a cached block never
outlives its parent, so the prefix index stays prefix-closed) and, for a hybrid model, one
pin on the checkpoint whose state it reads. Leases end with
``KVSaveFinished`` (confirmed or failed); until then the blocks cannot be reused, so a
finished sequence's blocks outlive it exactly as long as its saves.
"""

from __future__ import annotations

from typing import cast

import attrs
import numpy as np

from kvsched.statemachines import KVLOAD, KVSAVE, LoadEvent, LoadState, SaveEvent, SaveState

_NO_BLOCKS = np.zeros(0, dtype=np.int32)


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

    def transition(self, event: LoadEvent) -> None:
        self.state = cast(LoadState, KVLOAD.next_state(self.seq_id, self.state, event))

    @property
    def in_flight(self) -> bool:
        return self.state == LoadState.LOADING

    @property
    def open(self) -> bool:
        """Looked up or planned, not yet admitted: a waiting sequence's pending work."""
        return self.state in (LoadState.LOOKUP_PENDING, LoadState.PLANNED)


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

    def transition(self, event: SaveEvent) -> None:
        self.state = cast(SaveState, KVSAVE.next_state(self.save_id, self.state, event))


class TransferTable:
    def __init__(self) -> None:
        self.loads: dict[int, KVLoad] = {}
        self.leases: dict[int, Lease] = {}
        self.next_save_id = 0
        self.drain_pending = False
        self.loaded_blocks = 0  # statistics: blocks loaded successfully
        self.failed_loads = 0
        self.saved_blocks = 0  # statistics: blocks whose save the store confirmed
        self.failed_saves = 0

    # ------------------------------------------------------------------------- queries

    @property
    def busy(self) -> bool:
        """A load or a save is in flight."""
        return bool(self.leases) or any(ld.in_flight for ld in self.loads.values())

    def load_of(self, seq_id: int) -> KVLoad | None:
        return self.loads.get(seq_id)

    def in_flight_loads(self) -> list[int]:
        return sorted(s for s, ld in self.loads.items() if ld.in_flight)

    def lease_holders(self) -> list[np.ndarray]:
        return [lease.blocks for lease in self.leases.values() if len(lease.blocks)]

    def lease_pins(self) -> dict[int, int]:
        pins: dict[int, int] = {}
        for lease in self.leases.values():
            if lease.ckpt_id >= 0:
                pins[lease.ckpt_id] = pins.get(lease.ckpt_id, 0) + 1
        return pins

    # ------------------------------------------------------------------------ commands

    def start_lookup(self, seq_id: int, first: int, end: int, with_state: bool) -> None:
        if seq_id in self.loads:
            raise ValueError(f"sequence {seq_id} already has a load record")
        self.loads[seq_id] = KVLoad(seq_id, LoadState.LOOKUP_PENDING, first, end, with_state)

    def forget(self, seq_id: int, keep_failed: bool = False) -> None:
        """The sequence left its row (or the engine): drop its record (a FAILED one is kept
        on request, so a preempted sequence does not retry a store that failed it)."""
        load = self.loads.get(seq_id)
        if load is None or load.in_flight:
            return
        if keep_failed and load.state == LoadState.FAILED:
            return
        del self.loads[seq_id]

    def add_lease(self, lease: Lease) -> None:
        if lease.save_id != self.next_save_id:
            raise ValueError(f"save id {lease.save_id}, expected {self.next_save_id}")
        lease.transition(SaveEvent.start)
        self.leases[lease.save_id] = lease
        self.next_save_id += 1

    def end_lease(self, save_id: int, ok: bool) -> Lease | None:
        """The store answered a save: the lease ends (None: no such save in flight)."""
        lease = self.leases.pop(save_id, None)
        if lease is not None:
            lease.transition(SaveEvent.confirm if ok else SaveEvent.fail)
            if ok:
                self.saved_blocks += lease.num_saved
            else:
                self.failed_saves += 1
        return lease

    def check_invariants(self, loading_seqs: set[int]) -> str | None:
        """``loading_seqs``: the sequences in LOADING_KV. None when consistent."""
        flying = {s for s, ld in self.loads.items() if ld.in_flight}
        if flying != loading_seqs:
            return f"loads in flight {sorted(flying)} but sequences loading {sorted(loading_seqs)}"
        for load in self.loads.values():
            if not 0 <= load.first_block <= load.num_blocks:
                return f"load of {load.seq_id}: range [{load.first_block}, {load.num_blocks})"
            if load.in_flight and len(load.blocks) != load.num_blocks - load.first_block:
                return f"load of {load.seq_id}: {len(load.blocks)} destination blocks"
        for save_id, lease in self.leases.items():
            if save_id >= self.next_save_id or lease.save_id != save_id:
                return f"lease of save {save_id} is not a started save"
            if lease.state != SaveState.SAVING:
                return f"lease of save {save_id} in state {lease.state.name}"
        return None
