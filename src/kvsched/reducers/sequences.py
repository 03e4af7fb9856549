"""SequenceTable: every sequence's tokens, identity and lifecycle state, and the batch rows.

A sequence is WAITING (holds nothing), RUNNING (holds a batch row and a block table) or in a
terminal state. While running, its hot numbers live in numpy arrays indexed by row so a decode
step updates every running sequence in a few vectorised operations:

* ``computed[row]``: tokens whose KV is written (after the last executed step);
* ``ntokens[row]``: tokens known (prompt plus sampled outputs);
* ``nblocks[row]``: blocks in the row's block table; ``table[row, :nblocks]`` the ids;
* ``registered[row]``: leading blocks whose identity is in the prefix index;
* ``last_token[row]``: the newest token (the decode input).
"""

from __future__ import annotations

from typing import cast

import attrs
import numpy as np

from kvsched.events.types import MultimodalSpan
from kvsched.statemachines import SEQUENCE, SeqEvent, SeqState

FREE_ROW = -1
_NO_PATH = np.zeros(0, dtype=np.int32)
_NO_PATH.flags.writeable = False


@attrs.define(slots=True, eq=False)
class Seq:
    seq_id: int
    tokens: np.ndarray  # int32, capacity >= n_tokens
    n_tokens: int
    n_prompt: int  # tokens before this turn's first output
    max_tokens: int
    arrival_time: float
    priority: int = 0
    session_id: int = -1
    adapter: str = ""
    cache_salt: str = ""
    eos_token_id: int = -1
    temperature: float = 0.0
    seed: int = 0
    mm_spans: tuple[MultimodalSpan, ...] = ()
    root: bytes = b""
    hashes: list[bytes] = attrs.field(factory=list)
    # path[: registered] are the canonical cached blocks of this sequence's prefix (shared
    # with the block pool, which keeps (path, depth) per cached block; never rewritten).
    path: np.ndarray = attrs.field(factory=lambda: np.zeros(0, dtype=np.int32))
    state: SeqState = SeqState.WAITING
    row: int = FREE_ROW
    want_experts: bool = False  # the request asked for its routed-expert ids
    experts: np.ndarray | None = None  # [capacity, K] int16 routed-expert ids per token
    n_experts: int = 0  # leading tokens whose expert ids are known
    pinned_ckpt: int = -1  # hybrid: checkpoint restored at admission, pinned while running
    n_pinned: int = 0  # leading blocks of the block table covered by that pin (no own refs)
    num_failures: int = 0  # consecutive failed steps that computed this sequence
    num_preemptions: int = 0
    preempted_at: int = -1  # the step of the latest preemption
    finish_reason: str = ""
    # Statistics of the prefix match at the latest admission.
    num_hit_tokens: int = 0

    @property
    def n_output(self) -> int:
        return self.n_tokens - self.n_prompt

    def ensure_tokens(self, n: int) -> None:
        if len(self.tokens) < n:
            grown = np.empty(max(n, 16, 2 * len(self.tokens)), dtype=np.int32)
            grown[: self.n_tokens] = self.tokens[: self.n_tokens]
            self.tokens = grown

    def append(self, token: int) -> None:
        self.ensure_tokens(self.n_tokens + 1)
        self.tokens[self.n_tokens] = token
        self.n_tokens += 1

    def ensure_path(self, n: int) -> None:
        """Room for n path entries (a new array: the old one stays valid for its holders)."""
        if len(self.path) < n:
            grown = np.zeros(max(n, 2 * len(self.path), 16), dtype=np.int32)
            grown[: len(self.path)] = self.path
            self.path = grown

    def record_experts(self, start: int, ids: np.ndarray) -> None:
        """Expert ids of tokens [start, start + len(ids)); kept only while contiguous."""
        if start > self.n_experts:
            return
        end = start + len(ids)
        if self.experts is None or len(self.experts) < end:
            cap = max(end, 64, 2 * (0 if self.experts is None else len(self.experts)))
            grown = np.zeros((cap, ids.shape[1]), dtype=np.int16)
            if self.experts is not None:
                grown[: self.n_experts] = self.experts[: self.n_experts]
            self.experts = grown
        self.experts[start:end] = ids
        self.n_experts = max(self.n_experts, end)

    def token_view(self) -> np.ndarray:
        return self.tokens[: self.n_tokens]

    def transition(self, event: SeqEvent) -> None:
        # The compiled table returns the destination member itself: no enum construction.
        self.state = cast(SeqState, SEQUENCE.next_state(self.seq_id, self.state, event))


class SequenceTable:
    def __init__(self, max_batch: int, max_blocks_per_seq: int, block_size: int = 64) -> None:
        self.block_size = block_size
        # Sampled tokens not yet copied into their sequence's token array, by position % bs;
        # copied ("flushed") whenever a block fills and when the sequence leaves its row.
        self.tail = np.zeros((max_batch, block_size), dtype=np.int32)
        self.seqs: dict[int, Seq] = {}
        self.waiting: dict[int, Seq] = {}  # insertion-ordered
        self.max_batch = max_batch
        self.row_seq = np.full(max_batch, FREE_ROW, dtype=np.int64)
        self.computed = np.zeros(max_batch, dtype=np.int64)
        self.ntokens = np.zeros(max_batch, dtype=np.int64)
        self.nblocks = np.zeros(max_batch, dtype=np.int64)
        self.registered = np.zeros(max_batch, dtype=np.int64)
        self.last_token = np.zeros(max_batch, dtype=np.int32)
        # External KV: the row's prefix is loading (LOADING_KV); chain blocks [0, saved) are
        # in the store or being saved (or were matched locally).
        self.loading = np.zeros(max_batch, dtype=bool)
        self.saved = np.zeros(max_batch, dtype=np.int64)
        # Per-row request constants, written in one assignment at activation; the named
        # arrays are column views of it.
        self._consts = np.zeros((max_batch, 5), dtype=np.int64)
        self.n_prompt = self._consts[:, 0]
        self.max_tokens = self._consts[:, 1]
        self.eos = self._consts[:, 2]
        self.failures = self._consts[:, 3]  # mirrors Seq.num_failures
        self.seed = self._consts[:, 4]
        self.objs: list[Seq | None] = [None] * max_batch
        self.temperature = np.zeros(max_batch, dtype=np.float32)
        self.table = np.zeros((max_batch, max_blocks_per_seq), dtype=np.int32)
        self.free_rows: list[int] = list(range(max_batch - 1, -1, -1))
        self._version = 0  # bumped when rows are taken or freed (invalidates _row_index)
        self._row_index: tuple[int, np.ndarray, np.ndarray] | None = None
        self.num_finished = 0

    # ------------------------------------------------------------------------- queries

    @property
    def num_running(self) -> int:
        return self.max_batch - len(self.free_rows)

    def running_rows(self) -> np.ndarray:
        """Rows holding a sequence (RUNNING, or LOADING_KV: see ``loading``)."""
        return np.nonzero(self.row_seq != FREE_ROW)[0]

    def schedulable_rows(self) -> np.ndarray:
        """Rows whose sequence can compute (not waiting for a KV load)."""
        return np.nonzero((self.row_seq != FREE_ROW) & ~self.loading)[0]

    def rows_of(self, seq_ids: np.ndarray) -> np.ndarray:
        """Rows of running sequences, vectorised (raises KeyError if one is not running)."""
        if self._row_index is None or self._row_index[0] != self._version:
            order = np.argsort(self.row_seq, kind="stable")
            self._row_index = (self._version, order, self.row_seq[order])
        _, order, sorted_ids = self._row_index
        pos = np.searchsorted(sorted_ids, seq_ids)
        pos = np.minimum(pos, len(order) - 1)
        rows = order[pos]
        if len(seq_ids) and not np.array_equal(self.row_seq[rows], seq_ids):
            missing = seq_ids[self.row_seq[rows] != seq_ids]
            raise KeyError(f"sequences not running: {missing[:8].tolist()}")
        return rows

    def set_nblocks(self, row: int, n: int) -> None:
        """Shrink (or set) a row's block count; entries past it are kept zero (the null
        block), so plans copy block tables without masking."""
        old = int(self.nblocks[row])
        if n < old:
            self.table[row, n:old] = 0
        self.nblocks[row] = n

    def blocks_of(self, row: int) -> np.ndarray:
        return self.table[row, : self.nblocks[row]]

    def peek_free_row(self) -> int:
        return self.free_rows[-1] if self.free_rows else FREE_ROW

    # ------------------------------------------------------------------------ commands

    def add(self, seq: Seq) -> None:
        self.seqs[seq.seq_id] = seq
        self.waiting[seq.seq_id] = seq

    def activate(self, seq: Seq, row: int, event: SeqEvent = SeqEvent.admit) -> None:
        if self.row_seq[row] != FREE_ROW or self.free_rows[-1] != row:
            raise ValueError(f"row {row} is not the next free row")
        seq.transition(event)
        self.loading[row] = event == SeqEvent.begin_load
        self.free_rows.pop()
        self.waiting.pop(seq.seq_id, None)
        seq.row = row
        # A fresh path: the old one may be shared (read-only) or referenced by cached blocks.
        seq.path = _NO_PATH
        self.row_seq[row] = seq.seq_id
        self._version += 1
        # computed, nblocks and registered are zero for a free row (``deactivate``).
        self.ntokens[row] = seq.n_tokens
        self.last_token[row] = seq.tokens[seq.n_tokens - 1]
        self._consts[row] = (
            seq.n_prompt, seq.max_tokens, seq.eos_token_id, seq.num_failures, seq.seed
        )
        self.objs[row] = seq
        self.temperature[row] = seq.temperature

    def flush(self, row: int) -> Seq:
        """Copy the row's unflushed sampled tokens into its sequence; returns the sequence."""
        seq = self.objs[row]
        assert seq is not None
        n0, n1 = seq.n_tokens, int(self.ntokens[row])
        if n1 > n0:
            seq.ensure_tokens(n1)
            seq.tokens[n0:n1] = self.tail[row, np.arange(n0, n1) % self.block_size]
            seq.n_tokens = n1
        return seq

    def deactivate(self, seq: Seq) -> None:
        """Free the sequence's row (its blocks must have been released already)."""
        row = seq.row
        self.flush(row)
        self.row_seq[row] = FREE_ROW
        self._version += 1
        self.objs[row] = None
        self.set_nblocks(row, 0)
        self.computed[row] = 0
        self.registered[row] = 0
        self.loading[row] = False
        self.saved[row] = 0
        self.free_rows.append(row)
        seq.row = FREE_ROW

    def requeue(self, seq: Seq) -> None:
        self.waiting[seq.seq_id] = seq

    def retire(self, seq: Seq) -> None:
        """A terminal sequence leaves the table (its history stays in the event log)."""
        self.waiting.pop(seq.seq_id, None)
        del self.seqs[seq.seq_id]
        self.num_finished += 1
