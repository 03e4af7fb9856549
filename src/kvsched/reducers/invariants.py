"""Cross-owner invariants of EngineState: what no single owner can check alone.

Each owner checks its own structure (``BlockPool.check_invariants`` and so on); the checks
here relate owners: every holder's references against the pool's counts, batch rows against
sequences' states, checkpoint pins against the sequences and leases that pin them, loads
against the sequences loading, sessions against live sequences.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvsched.config import SchedulerConfig
from kvsched.reducers.blocks import BlockPool, BlockPoolError
from kvsched.reducers.checkpoints import CheckpointTable
from kvsched.reducers.errors import InvariantError
from kvsched.reducers.future import FutureUses, reads_future
from kvsched.reducers.holdings import LoadHoldings
from kvsched.reducers.seq import FREE_ROW, Seq
from kvsched.reducers.sequences import SequenceTable
from kvsched.reducers.sessions import SessionTable
from kvsched.reducers.transfers import TransferTable
from kvsched.reducers.turns import Turns
from kvsched.reducers.work import Serving
from kvsched.statemachines import SeqState


class Owners(Protocol):
    """The owners the cross-owner checks relate (an ``EngineState``)."""

    config: SchedulerConfig
    block_size: int
    hybrid: bool
    pool: BlockPool
    seqs: SequenceTable
    holdings: LoadHoldings
    sessions: SessionTable
    ckpts: CheckpointTable
    transfers: TransferTable
    serving: Serving
    turns: Turns
    future: FutureUses

    def holders(self) -> list[np.ndarray]: ...

_LIVE = (SeqState.RUNNING, SeqState.LOADING_KV)


def check_all(state: Owners) -> None:
    """Raise InvariantError naming the first violation."""
    try:
        state.pool.check_invariants(state.holders())
    except BlockPoolError as exc:
        raise InvariantError(str(exc)) from exc
    _check_rows(state)
    pins: dict[int, int] = {}
    for seq in state.seqs.seqs.values():
        _check_seq(state, seq)
        if seq.pinned_ckpt >= 0:
            pins[seq.pinned_ckpt] = pins.get(seq.pinned_ckpt, 0) + 1
    future = reads_future(state.config)
    for problem in (
        state.ckpts.check_invariants(pins),
        state.sessions.check_invariants(set(state.seqs.seqs)),
        state.serving.check_invariants(),
        state.turns.check_invariants(),
        state.future.check_invariants(set(state.ckpts.ckpts)) if future else None,
    ):
        if problem is not None:
            raise InvariantError(problem)
    _check_transfers(state)


def _check_rows(state: Owners) -> None:
    t = state.seqs
    problem = t.check_pipeline()
    if problem is not None:
        raise InvariantError(problem)
    used = set(t.running_rows().tolist())
    pending = set(t.pending_arrays()[0].tolist())
    for row in np.nonzero(t.verifying)[0].tolist():
        if row not in pending or not t.verifying[row] <= t.ndrafts[row]:
            raise InvariantError(f"row {row} verifies drafts it was not scheduled with")
    if t.verifying.any() != t.any_verifying:
        raise InvariantError("the verifying flag disagrees with the rows")
    if np.any(t.ndrafts[t.free_rows] != 0) or np.any(t.ndrafts > t.max_drafts):
        raise InvariantError("drafts kept by a free row, or more than max_drafts")
    most = state.config.model.max_adapters
    if most and len(t.running_adapters()) > most:
        raise InvariantError(f"more than model.max_adapters ({most}) adapters run at once")
    if used & set(t.free_rows) or len(used) + len(t.free_rows) != t.max_batch:
        raise InvariantError("batch rows are not partitioned into used and free")
    entered = t.entered[sorted(used)]
    if np.any(entered <= 0) or len(set(entered.tolist())) != len(used):
        raise InvariantError("used rows do not each have their own time of entry")
    for row in used:
        seq = t.seqs.get(int(t.row_seq[row]))
        if seq is None or seq.row != row or seq.state not in _LIVE:
            raise InvariantError(f"row {row} holds a sequence that is not running there")
        if t.row_state[row] != seq.state or t.objs[row] is not seq:
            raise InvariantError(f"row {row}: its state column disagrees with its sequence")


def _check_seq(state: Owners, seq: Seq) -> None:
    t, bs = state.seqs, state.block_size
    n_tokens = int(t.ntokens[seq.row]) if seq.row != FREE_ROW else seq.n_tokens
    if len(seq.hashes) != n_tokens // bs:
        raise InvariantError(f"sequence {seq.seq_id}: {len(seq.hashes)} hashes")
    if seq.row != FREE_ROW and t.ndrafts[seq.row] and seq.state != SeqState.RUNNING:
        raise InvariantError(f"sequence {seq.seq_id} keeps drafts outside a running row")
    if seq.state == SeqState.WAITING:
        if seq.pinned_ckpt >= 0 or seq.n_pinned:
            raise InvariantError(f"waiting sequence {seq.seq_id} pins a checkpoint")
        rowless = state.holdings.is_rowless(seq.seq_id)
        if seq.row != FREE_ROW or rowless or seq.seq_id not in t.waiting:
            raise InvariantError(f"waiting sequence {seq.seq_id} holds a row or is unqueued")
        return
    if seq.state not in _LIVE:
        raise InvariantError(f"sequence {seq.seq_id} is in state {seq.state.name}")
    if seq.row == FREE_ROW:
        _check_rowless(state, seq)
        return
    row = seq.row
    if state.holdings.is_rowless(seq.seq_id):
        raise InvariantError(f"sequence {seq.seq_id} holds blocks outside its row")
    if seq.seq_id in t.waiting:
        raise InvariantError(f"running sequence {seq.seq_id} is also queued")
    computed, nblocks = int(t.computed[row]), int(t.nblocks[row])
    if not seq.n_tokens <= n_tokens < seq.n_tokens + bs:
        raise InvariantError(f"sequence {seq.seq_id}: token count disagrees with its row")
    # (the newest token is never computed: it is the next decode's input; overlapped steps:
    # nor the newest placeholder)
    if computed >= n_tokens + int(t.ahead[row]) or computed > nblocks * bs:
        raise InvariantError(f"sequence {seq.seq_id}: computed {computed} out of range")
    planned = int(t.planned_of(np.asarray([row]))[0]) if state.config.cache_when_planned else 0
    if int(t.registered[row]) > max(computed, planned) // bs:
        raise InvariantError(f"sequence {seq.seq_id}: registered past its computed tokens")
    hash_of = state.pool.hash_of
    private_ok = not state.config.dedup_cached_blocks  # a duplicate kept as a private copy
    for i in range(int(t.registered[row])):
        h = hash_of[int(t.table[row, i])]
        if i == seq.overlap_at and h is None:  # an MTP private copy: the overlap is cached
            h = hash_of[seq.overlap_block]
        if h != seq.hashes[i] and not (private_ok and h is None):
            raise InvariantError(f"sequence {seq.seq_id}: block {i} has another identity")
    if seq.overlap_block and not (
        seq.n_pinned <= seq.overlap_at < nblocks
        and hash_of[seq.overlap_block] == seq.hashes[seq.overlap_at]
    ):
        raise InvariantError(f"sequence {seq.seq_id}: its MTP overlap block is not its chain's")


def _check_rowless(state: Owners, seq: Seq) -> None:
    """A load without a batch row: LOADING_KV, not queued, no pin, no MTP overlap; it holds
    its local prefix (cached, its own identities) and then the blocks it loads into, within
    its prompt."""
    t, bs = state.seqs, state.block_size
    pinned = seq.pinned_ckpt >= 0 or seq.overlap_block
    if seq.state != SeqState.LOADING_KV or seq.seq_id in t.waiting or pinned:
        raise InvariantError(f"sequence {seq.seq_id} holds no row in state {seq.state.name}")
    held = state.holdings.blocks_of(seq.seq_id)
    if len(held) > -(-seq.n_tokens // bs):
        raise InvariantError(f"load of {seq.seq_id}: {len(held)} blocks held")
    hash_of = state.pool.hash_of
    for i in range(state.holdings.cached_of(seq.seq_id)):
        if hash_of[int(held[i])] != seq.hashes[i]:
            raise InvariantError(f"load of {seq.seq_id}: block {i} has another identity")


def _check_transfers(state: Owners) -> None:
    t = state.seqs
    loading = {s.seq_id for s in t.seqs.values() if s.state == SeqState.LOADING_KV}
    in_rows = {s for s in loading if t.seqs[s].row != FREE_ROW}
    rows = {int(t.row_seq[r]) for r in np.nonzero(t.loading)[0].tolist()}
    if rows != in_rows:
        raise InvariantError(f"loading rows {sorted(rows)} vs loading seqs {sorted(in_rows)}")
    # A hybrid load without a row writes its state to a checkpoint slot of its own.
    rowless = loading - in_rows if state.hybrid else set()
    if set(state.ckpts.load_slots) != rowless:
        raise InvariantError(f"loads owning state slots {sorted(state.ckpts.load_slots)}, "
                             f"hybrid loads without a row {sorted(rowless)}")
    for problem in (
        state.transfers.check_invariants(loading),
        state.holdings.check_invariants(loading - in_rows),
    ):
        if problem is not None:
            raise InvariantError(problem)
    for seq_id, load in state.transfers.loads.items():
        seq = t.seqs.get(seq_id)
        if seq is None:
            raise InvariantError(f"load record of retired sequence {seq_id}")
        if load.open and seq.state != SeqState.WAITING:
            raise InvariantError(f"open load of {seq_id}, which is {seq.state.name}")
