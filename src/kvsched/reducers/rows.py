"""RowTable: the batch rows of the sequences that hold one, as numpy arrays.

While a sequence holds a row (LOADING_KV or RUNNING), its hot numbers live in arrays indexed
by row, so a decode step updates every running sequence in a few vectorised operations:

* ``computed[row]``: tokens whose KV is written (after the last executed step);
* ``ntokens[row]``: tokens known (prompt plus sampled outputs);
* ``nblocks[row]``: blocks in the row's block table; ``table[row, :nblocks]`` the ids;
* ``registered[row]``: leading blocks whose identity is in the prefix index (canonical ids);
* ``last_token[row]``: the newest token (the decode input);
* ``row_state[row]``: the sequence's lifecycle state (for vectorised trigger checks).

It also keeps the work scheduled in the current step until its outcome arrives
(``pending_arrays``). ``SequenceTable`` (``sequences.py``) builds on it.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from kvsched.config import ModelSpec
from kvsched.events import types as ev
from kvsched.reducers.errors import ReplayMismatch
from kvsched.reducers.seq import FREE_ROW, Seq
from kvsched.statemachines import SEQUENCE, fire

_MEMO = 3  # rows_of answers kept
_NO_ROWS = np.zeros(0, dtype=np.int64)


class RowTable:
    def __init__(self, max_batch: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        # Full blocks may be cached once planned, before their step ran (config's
        # cache_when_planned): BlocksCached may then reach past the computed tokens.
        self.cache_when_planned = False
        # Sampled tokens not yet copied into their sequence's token array, by position % bs;
        # copied ("flushed") whenever a block fills and when the sequence leaves its row.
        self.tail = np.zeros((max_batch, block_size), dtype=np.int32)
        self.max_batch = max_batch
        self.row_seq = np.full(max_batch, FREE_ROW, dtype=np.int64)
        self.row_state = np.zeros(max_batch, dtype=np.int64)
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
        # Columns zeroed when a row is freed (``deactivate``; a table built on this one may
        # add its own).
        self.freed_columns = [self.computed, self.registered, self.loading, self.saved]
        self.objs: list[Seq | None] = [None] * max_batch
        # When each row's sequence took it: the count of activations so far (vLLM's running
        # list is in this order: a request is appended when it is scheduled from waiting).
        self.entered = np.zeros(max_batch, dtype=np.int64)
        self._entries = 0
        self.temperature = np.zeros(max_batch, dtype=np.float32)
        self.table = np.zeros((max_batch, max_blocks_per_seq), dtype=np.int32)
        self.free_rows: list[int] = list(range(max_batch - 1, -1, -1))
        self._version = 0  # bumped when rows are taken or freed (invalidates _row_index)
        self._row_index: tuple[int, np.ndarray, np.ndarray] | None = None
        # The latest answers of rows_of (a cache: (version, id array, rows), newest last).
        self._rows_memo: list[tuple[int, np.ndarray, np.ndarray]] = []
        self.step = 0
        self.pipelined = False  # overlapped steps (``PipelinedRows``)
        # Work of the current step awaiting the executor's outcome: the rows, first and end
        # positions of each piece, in the order it was scheduled (the plan's order).
        self.pending_step = 0
        self.has_pending = False  # (a step may have work and no rows: a checkpoint's save)
        self._pending_rows = self._pending_starts = self._pending_ends = _NO_ROWS

    # ------------------------------------------------------------------------- queries

    @property
    def num_running(self) -> int:
        return self.max_batch - len(self.free_rows)

    def running_rows(self) -> np.ndarray:
        """Rows holding a sequence (RUNNING, or LOADING_KV: see ``loading``)."""
        return np.nonzero(self.row_seq != FREE_ROW)[0]

    def running_adapters(self) -> set[str]:
        """The distinct adapters (LoRA) of the sequences that hold a row ("": none)."""
        return {s.adapter for s in self.objs if s is not None and s.adapter}

    def schedulable_rows(self) -> np.ndarray:
        """Rows whose sequence can compute (not waiting for a KV load)."""
        return np.nonzero((self.row_seq != FREE_ROW) & ~self.loading)[0]

    def rows_of(self, seq_ids: np.ndarray, guess: np.ndarray | None = None) -> np.ndarray:
        """Rows of running sequences, vectorised (ReplayMismatch if one is not running);
        ``guess``: the rows a caller expects them in (checked, and then no lookup is needed).
        The latest few answers are kept: an event's id array is looked up by several owners
        (and an outcome's by the stop rule, after the folds of the blocks it filled)."""
        for version, ids, rows in self._rows_memo:
            if ids is seq_ids and version == self._version:
                return rows
        if guess is not None and np.array_equal(self.row_seq[guess], seq_ids):
            rows = guess
        else:
            if self._row_index is None or self._row_index[0] != self._version:
                order = np.argsort(self.row_seq, kind="stable")
                self._row_index = (self._version, order, self.row_seq[order])
            _, order, sorted_ids = self._row_index
            pos = np.minimum(np.searchsorted(sorted_ids, seq_ids), len(order) - 1)
            rows = order[pos]
            if len(seq_ids) and not np.array_equal(self.row_seq[rows], seq_ids):
                missing = seq_ids[self.row_seq[rows] != seq_ids]
                raise ReplayMismatch(f"sequences not running: {missing[:8].tolist()}")
        memo = self._rows_memo
        if len(memo) == _MEMO:
            del memo[0]
        memo.append((self._version, seq_ids, rows))
        return rows

    def num_tokens(self, seq: Seq) -> int:
        """Tokens the sequence knows (its row's count, sampled tokens not yet flushed too)."""
        return int(self.ntokens[seq.row]) if seq.row != FREE_ROW else seq.n_tokens

    def tokens_upto(self, seq: Seq, n: int) -> np.ndarray:
        """The sequence's first ``n`` tokens (at most those known), without flushing: a view
        of its token array, or a copy with the row's unflushed sampled tokens appended."""
        row = seq.row
        if row == FREE_ROW or n <= seq.n_tokens:
            return seq.tokens[:n]
        n0, n1 = seq.n_tokens, min(n, int(self.ntokens[row]))
        tail = self.tail[row, np.arange(n0, n1) % self.block_size]
        return np.concatenate((seq.tokens[:n0], tail))

    def blocks_of(self, row: int) -> np.ndarray:
        """The row's block table (a read-only view)."""
        view = self.table[row, : self.nblocks[row]]
        view.flags.writeable = False
        return view

    # Per-row questions the policy asks. Arrays are copies (fancy indexing), numbers ints:
    # nothing returned here can write a column.

    def seq_at(self, row: int) -> Seq:
        """The sequence holding ``row``."""
        seq = self.objs[row]
        assert seq is not None, f"row {row} is free"
        return seq

    def seqs_at(self, rows: np.ndarray) -> list[Seq]:
        """The sequences holding ``rows``, in order (each row must hold one)."""
        objs = self.objs
        seqs = [objs[r] for r in rows.tolist()]
        assert all(s is not None for s in seqs), "a free row"
        return cast("list[Seq]", seqs)

    def ids_at(self, rows: np.ndarray) -> np.ndarray:
        """The ids of the sequences holding ``rows``."""
        return self.row_seq[rows]  # type: ignore[no-any-return]

    def still_held(self, rows: np.ndarray) -> np.ndarray:
        """Those of ``rows`` that still hold a sequence (none preempted or ended meanwhile)."""
        return rows[self.row_seq[rows] >= 0]  # type: ignore[no-any-return]

    def computed_at(self, row: int) -> int:
        """Tokens of the row whose KV is written."""
        return int(self.computed[row])

    def nblocks_at(self, row: int) -> int:
        """Blocks in the row's block table."""
        return int(self.nblocks[row])

    def registered_at(self, row: int) -> int:
        """Leading blocks of the row in the prefix index."""
        return int(self.registered[row])

    def indexed_from(self, row: int, first: int) -> list[tuple[int, int, bytes]]:
        """(depth, block, hash) of the row's blocks in the prefix index from block ``first``
        on (none when the index holds no deeper one)."""
        last = int(self.registered[row])
        if last <= first:
            return []
        seq = self.objs[row]
        assert seq is not None
        blocks = self.table[row, first:last].tolist()
        return [(first + k, b, seq.hashes[first + k]) for k, b in enumerate(blocks)]

    def saved_at(self, row: int) -> int:
        """Leading chain blocks of the row in the store or being saved."""
        return int(self.saved[row])

    def computed_of(self, rows: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.computed[rows]
        return out

    def block_counts(self, rows: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.nblocks[rows]
        return out

    def known_of(self, rows: np.ndarray) -> np.ndarray:
        """Tokens each row knows (prompt and sampled outputs)."""
        return self.ntokens[rows]  # type: ignore[no-any-return]

    def tokens_left(self, rows: np.ndarray) -> np.ndarray:
        """Tokens each row knows but has not computed."""
        left: np.ndarray = self.ntokens[rows] - self.computed[rows]
        return left

    def token_limits(self, rows: np.ndarray) -> np.ndarray:
        """Each row's prompt plus its ``max_tokens``."""
        limit: np.ndarray = self.n_prompt[rows] + self.max_tokens[rows]
        return limit

    def outputs_done(self, rows: np.ndarray) -> np.ndarray:
        """Whether each row has sampled its ``max_tokens`` outputs."""
        return (  # type: ignore[no-any-return]
            self.ntokens[rows] - self.n_prompt[rows] >= self.max_tokens[rows]
        )

    def is_eos(self, rows: np.ndarray) -> np.ndarray:
        """Whether each row's newest token is its end-of-sequence token."""
        return self.last_token[rows] == self.eos[rows]  # type: ignore[no-any-return]

    def rows_needing_blocks(self, rows: np.ndarray) -> np.ndarray:
        """Those of ``rows`` whose next token's position lies past their block table."""
        return (  # type: ignore[no-any-return]
            rows[self.computed[rows] // self.block_size >= self.nblocks[rows]]
        )

    def blocks_short(self, rows: np.ndarray, extra: np.ndarray | int, limit: int) -> np.ndarray:
        """Blocks each decoding row lacks for its newest token and ``extra`` more positions
        (drafts, lookahead slots), none past position ``limit``."""
        ends = np.minimum(self.computed[rows] + 1 + extra, limit)
        short: np.ndarray = np.maximum(0, -(-ends // self.block_size) - self.nblocks[rows])
        return short

    def planned_of(self, rows: np.ndarray) -> np.ndarray:
        """Tokens of each row whose KV is written or being written by the current step's plan
        (its pending work's end; its computed tokens when it has none), of its known tokens:
        drafts' positions are planned, but their tokens are not known (overlapped steps: nor
        those of the drafts in flight)."""
        out: np.ndarray = self.computed[rows].copy()
        if len(self._pending_rows):
            ends = np.full(self.max_batch, -1, dtype=np.int64)
            ends[self._pending_rows] = self._pending_ends
            out = np.maximum(out, ends[rows])
        return np.minimum(out, self.ntokens[rows])  # type: ignore[no-any-return]

    def rows_to_cache(
        self, rows: np.ndarray | None = None, planned: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, first, last): the rows (of ``rows``, default all) with full computed blocks
        (``planned``: computed by the step's plan too) not in the prefix index yet, and each
        one's block range [first, last) of them."""
        bs = self.block_size
        if planned:
            assert rows is not None, "planned blocks are cached for the rows just scheduled"
            full = self.planned_of(rows) // bs
            grown = full > self.registered[rows]
            return rows[grown], self.registered[rows[grown]], full[grown]
        computed = self.computed
        if self.pipelined and not self.cache_when_planned:
            computed = self.cacheable()
        elif self.pipelined:  # (launched work counts, as at planning: its tokens known)
            computed = np.minimum(self.computed, self.ntokens)
        if rows is None:
            grown = np.nonzero(computed // bs > self.registered)[0]
        else:
            grown = rows[computed[rows] // bs > self.registered[rows]]
        return grown, self.registered[grown], computed[grown] // bs

    def departed(self, row: int) -> None:
        """A row's sequence left it (overlapped steps: ``PipelinedRows`` records it)."""

    def cached_after_launch(self, rows: np.ndarray, starts: np.ndarray) -> None:
        """Blocks [starts, registered) of ``rows`` just entered the prefix index
        (overlapped steps: ``PipelinedRows`` records those a step in flight writes)."""

    def cacheable(self) -> np.ndarray:
        """Each row's computed tokens whose KV may be cached (all of them; ``PipelinedRows``:
        not those a step in flight writes)."""
        return self.computed

    def blocks_in(self, rows: np.ndarray, firsts: np.ndarray, lasts: np.ndarray) -> np.ndarray:
        """Entries [first, last) of each row's block table, concatenated (a new array)."""
        table = self.table
        if not len(rows):
            return np.zeros(0, dtype=table.dtype)
        spans = zip(rows.tolist(), firsts.tolist(), lasts.tolist(), strict=True)
        return np.concatenate([table[row, first:last] for row, first, last in spans])

    def latest_entered_first(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` by when their sequences took them, the latest first (a copy)."""
        out: np.ndarray = rows[np.argsort(-self.entered[rows], kind="stable")]
        return out

    def rows_to_save(self, rows: np.ndarray) -> np.ndarray:
        """Those of ``rows`` with written indexed blocks not yet in the store nor being
        saved."""
        out: np.ndarray = rows[self.written_blocks(rows) > self.saved[rows]]
        return out

    def written_blocks(self, rows: np.ndarray) -> np.ndarray:
        """Each row's leading indexed blocks whose KV is written (``PipelinedRows``: not all)."""
        indexed: np.ndarray = self.registered[rows]
        return indexed

    def peek_free_row(self) -> int:
        return self.free_rows[-1] if self.free_rows else FREE_ROW

    def pending_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, starts, ends) of the work scheduled in the current step, in plan order."""
        return self._pending_rows, self._pending_starts, self._pending_ends

    # ------------------------------------------------------------------------ commands

    def _reset_failures(self, rows: np.ndarray) -> None:
        for row in rows[self.failures[rows] > 0].tolist():  # a success resets the count
            seq = self.objs[row]
            assert seq is not None
            seq.num_failures = 0
            self.failures[row] = 0

    def _record_experts(
        self,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        flat: np.ndarray,
        model: ModelSpec,
    ) -> None:
        """Each computed token's routed-expert ids, into its sequence."""
        ids = flat.reshape(-1, model.routed_experts_per_token)
        offset = 0
        for row, start, end in zip(rows.tolist(), starts.tolist(), ends.tolist(), strict=True):
            seq = self.objs[row]
            assert seq is not None
            seq.record_experts(start, ids[offset : offset + end - start])
            offset += end - start

    def clear_pending(self) -> None:
        """The pending step's work is done with (its outcome folded, or launched)."""
        self._pending_rows, self._pending_starts, self._pending_ends, self.has_pending = (
            _NO_ROWS, _NO_ROWS, _NO_ROWS, False
        )

    def set_nblocks(self, row: int, n: int) -> None:
        """Shrink (or set) a row's block count; entries past it are kept zero (the null
        block), so plans copy block tables without masking."""
        old = int(self.nblocks[row])
        if n < old:
            self.table[row, n:old] = 0
        self.nblocks[row] = n

    def activate(self, seq: Seq, row: int, event: ev.Event) -> None:
        """The sequence takes batch row ``row`` (its lifecycle trigger is the one ``event``
        fires; a load admitted into a row waits for its KV there: ``loading``)."""
        if not self.free_rows or self.free_rows[-1] != row:
            raise ReplayMismatch(f"sequence {seq.seq_id}: row {row} is not the next free row")
        seq.state = fire(SEQUENCE, event, seq.seq_id, seq.state)
        self.loading[row] = type(event) is ev.KVLoadAdmitted
        self.row_state[row] = seq.state
        self.free_rows.pop()
        seq.row = row
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
        self._entries += 1
        self.entered[row] = self._entries

    def flush(self, row: int) -> Seq:
        """Copy the row's unflushed sampled tokens into its sequence, growing its token array
        into a copy when it is full (a prompt's is the event's, read-only); returns the
        sequence."""
        seq = self.objs[row]
        assert seq is not None
        n0, n1, bs = seq.n_tokens, int(self.ntokens[row]), self.block_size
        if n1 > n0:
            if len(seq.tokens) < n1:
                grown = np.empty(max(n1, 16, 2 * len(seq.tokens)), dtype=np.int32)
                grown[:n0] = seq.tokens[:n0]
                seq.tokens = grown
            if n1 - n0 == bs and n0 % bs == 0:  # exactly one whole block: the tail in order
                seq.tokens[n0:n1] = self.tail[row]
            else:
                seq.tokens[n0:n1] = self.tail[row, np.arange(n0, n1) % bs]
            seq.n_tokens = n1
        return seq

    def deactivate(self, seq: Seq) -> None:
        """Free the row of a sequence that leaves it. Its release (``BlocksFreed`` and
        ``CheckpointUnpinned``, which ``Growth.end`` emits before every end) must come
        first: its block count is zero then, and so is every table entry (``set_nblocks``).
        A load without a row has none (``LoadHoldings`` checks its blocks)."""
        row = seq.row
        if row == FREE_ROW:
            return
        if self.nblocks[row] or seq.overlap_block:
            raise ReplayMismatch(
                f"sequence {seq.seq_id} left running with blocks held (its BlocksFreed and "
                "CheckpointUnpinned must come before its end: Growth.end)"
            )
        self.flush(row)
        self.row_seq[row] = FREE_ROW
        self.row_state[row] = 0
        self._version += 1
        self.objs[row] = None
        for column in self.freed_columns:
            column[row] = 0
        self.free_rows.append(row)
        seq.row = FREE_ROW
        if self.pipelined:
            self.departed(row)
