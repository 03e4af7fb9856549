"""Decisions about state kept beside the batch: hybrid-model checkpoints and external KV
lookups, loads and saves. Replay recomputes them and compares."""

from __future__ import annotations

import numpy as np

from kvsched.events.base import Event


class CheckpointReserved(Event, frozen=True, tag="ckpt_reserved"):
    """Save the state of ``seq_id`` after ``num_tokens`` tokens into ``slot`` (and, for a
    non-aligned step, its partial block into ``frozen_block``). ``key`` is the checkpoint's
    identity (the index key once published); ``anchor`` the hash of its last full block (the
    namespace root below one block); ``kind`` the placement rule that chose it
    (``config.PLACEMENTS``). ``phase``: when this step's executor saves it: "after" the
    forward (the state at the end of the sequence's work of this step), "within" the forward
    (mid-chunk, at a block boundary), or "before" it (a sequence that finished in the step
    just executed: its runtime slot still holds its final state)."""

    ckpt_id: int
    seq_id: int
    slot: int
    num_tokens: int
    key: bytes
    anchor: bytes
    frozen_block: int = 0
    kind: str = ""
    phase: str = "after"


class CheckpointPublished(Event, frozen=True, tag="ckpt_published"):
    ckpt_id: int


class CheckpointPinned(Event, frozen=True, tag="ckpt_pinned"):
    ckpt_id: int
    seq_id: int


class CheckpointUnpinned(Event, frozen=True, tag="ckpt_unpinned"):
    ckpt_id: int
    seq_id: int


class CheckpointAbandoned(Event, frozen=True, tag="ckpt_abandoned"):
    """A reserved checkpoint is dropped before publication (its step failed, or a checkpoint
    of the same identity was published first)."""

    ckpt_id: int
    reason: str


class CheckpointReleased(Event, frozen=True, tag="ckpt_released"):
    """A published checkpoint is released (drain): its slot and references go."""

    ckpt_id: int
    reason: str


class CheckpointEvicted(Event, frozen=True, tag="ckpt_evicted"):
    """An unpinned checkpoint is evicted for room; ``priority``: its eviction priority under
    the "value" eviction (the table's aging floor rises to it), else None."""

    ckpt_id: int
    priority: float | None = None


class KVLookupStarted(Event, frozen=True, tag="kv_lookup_started"):
    """Ask the external store how many blocks of the chain ``[first_block, num_blocks)`` it
    holds (the engine has ``[0, first_block)`` itself). ``answer``: -1, the answer comes
    later (``KVLookupAnswered``, an input); else the store answered within the step (the
    step's lookup port, ``Engine.step(lookups=...)``: a connector asked synchronously, as
    vLLM asks ``get_num_new_matched_tokens``), with ``KVLookupAnswered.num_blocks``'s
    meaning, and ``sync_load`` its ``sync_load``; the log keeps them, so a replay answers
    the same."""

    seq_id: int
    first_block: int
    num_blocks: int
    root: bytes  # the chain's namespace root (store keys are made of it and the hashes)
    hashes: bytes  # 16 bytes per block of [first_block, num_blocks)
    with_state: bool = False  # hybrid: a hit must end at a block with a stored state
    answer: int = -1
    sync_load: bool = False  # (answered) its load runs within the step that starts it


class KVLoadCancelled(Event, frozen=True, tag="kv_load_cancelled"):
    """A lookup or planned load is dropped (abort, drain, or the local cache serves it)."""

    seq_id: int
    reason: str


class KVLoadAdmitted(Event, frozen=True, tag="kv_load_admitted"):
    """Admit a sequence whose chain blocks ``[first_block, num_blocks)`` are loaded from the
    store: it waits in LOADING_KV until the load settles. ``row`` -1: it takes no batch row
    and holds only its local prefix and the blocks it loads into (``load_admission="soft"``);
    else it takes batch row ``row`` (and every block of its prompt: before schema 4)."""

    seq_id: int
    row: int
    first_block: int
    num_blocks: int


class KVLoadStarted(Event, frozen=True, tag="kv_load_started"):
    """Load chain blocks ``[first_block, first_block + len(blocks))`` (hashes ``hashes``
    under ``root``) into ``blocks`` and, for a hybrid model, the state stored at the block
    with hash ``state_hash`` into ``state_slot``. ``synchronous``: the executor loads them
    before the forward of the step that first runs the sequence (vLLM's synchronous
    connectors), so the load has ended when it starts (no ``KVLoadFinished`` follows)."""

    seq_id: int
    blocks: np.ndarray
    first_block: int
    root: bytes
    hashes: bytes  # 16 bytes per loaded block
    state_slot: int = -1
    state_hash: bytes = b""
    synchronous: bool = False


class KVLoadSettled(Event, frozen=True, tag="kv_load_settled"):
    """The sequence's load ended (finished or failed): it runs from its first ``num_blocks``
    chain blocks (a failed load keeps its good leading blocks for an attention model, none
    beyond its local prefix for a hybrid model, which has no state there). A load without a
    row is settled when it is admitted: it takes batch row ``row`` with the blocks it holds
    and, hybrid, the loaded state is restored from ``state_slot`` into the row's runtime
    slot (the slot is freed)."""

    seq_id: int
    num_blocks: int
    row: int = -1
    state_slot: int = -1


class KVSaveStarted(Event, frozen=True, tag="kv_save_started"):
    """Save chain blocks ``[first_block, first_block + len(blocks))`` of ``seq_id`` under the
    keys made of ``root`` and ``hashes`` (and, for a hybrid model, checkpoint ``ckpt_id``'s
    state from ``state_slot`` under the last block's hash). The save holds a lease (block
    references on the whole prefix up to its last block, a checkpoint pin) until
    ``KVSaveFinished``."""

    save_id: int
    seq_id: int
    blocks: np.ndarray
    first_block: int
    root: bytes
    hashes: bytes  # 16 bytes per saved block
    ckpt_id: int = -1
    state_slot: int = -1
