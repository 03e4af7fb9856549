"""plan_step: the fold of one step's scheduled work and copies into a frozen ``StepPlan``.

Reads the sequence table (the work scheduled this step, block tables, tokens, sampling
parameters) and the step's extras (``StepWork``); returns read-only arrays.
"""

from __future__ import annotations

import numpy as np

from kvsched.plan import StepPlan
from kvsched.reducers.checkpoints import CheckpointTable
from kvsched.reducers.state import EngineState


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr


_EMPTY2 = _frozen(np.zeros((0, 2), dtype=np.int32))
_EMPTY3 = _frozen(np.zeros((0, 3), dtype=np.int32))
_EMPTY1 = _frozen(np.zeros(0, dtype=np.int32))


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    if not pairs:
        return _EMPTY2  # (read-only, shared: most steps copy nothing)
    return _frozen(np.asarray(pairs, dtype=np.int32).reshape(len(pairs), 2))


def plan_step(state: EngineState) -> StepPlan:
    """Fold the step's scheduled work (``SequenceTable.pending_arrays``) and copies
    (``StepWork.extras``) into a frozen plan."""
    table, bs, x = state.seqs, state.block_size, state.work.extras
    hit_tokens, query_tokens = state.work.step_hits()
    rows, starts, ends = table.pending_arrays()
    lens = ends - starts
    total = int(lens.sum())
    if total == len(rows):  # one token per sequence (a decode step): no ragged expansion
        bounds = np.arange(total + 1)
        positions, token_rows = starts.copy(), rows
    else:
        bounds = np.concatenate(([0], np.cumsum(lens)))
        positions = np.arange(total, dtype=np.int64) - np.repeat(bounds[:-1] - starts, lens)
        token_rows = np.repeat(rows, lens)
    slots = table.table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
    input_ids = np.empty(total, dtype=np.int32)
    decode = (lens == 1) & (starts == table.ntokens[rows] - 1)
    input_ids[bounds[:-1][decode]] = table.last_token[rows[decode]]
    for i in np.nonzero(~decode)[0].tolist():
        seq = state.seqs.seq(int(table.row_seq[rows[i]]))
        input_ids[bounds[i] : bounds[i + 1]] = seq.tokens[starts[i] : ends[i]]
    nblocks = -(-ends // bs)
    width = int(nblocks.max()) if len(nblocks) else 0
    tables = table.table[rows, :width]  # entries past a row's blocks are kept zero
    return StepPlan(
        step=state.step,
        clock=state.clock,
        block_size=bs,
        seq_ids=_frozen(table.row_seq[rows].copy()),
        starts=_frozen(starts),
        ends=_frozen(ends),
        sample=_frozen(ends == table.ntokens[rows]),
        input_ids=_frozen(input_ids),
        positions=_frozen(positions),
        slot_mapping=_frozen(slots),
        block_tables=_frozen(tables),
        num_blocks=_frozen(nblocks.astype(np.int32)),
        copy_blocks=_pairs(
            x.copy_before + [(f, int(table.table[r, i])) for r, i, f in x.restore_blocks]
        ),
        zero_blocks=_EMPTY1,
        state_slots=_frozen(
            CheckpointTable.runtime_slots(rows) if state.hybrid else np.zeros(len(rows), np.int32)
        ),
        state_zero=_frozen(np.asarray(x.state_zero, dtype=np.int32)) if x.state_zero else _EMPTY1,
        state_restore=_pairs(x.state_restore),
        state_save=_pairs(x.state_save),
        copy_blocks_after=_pairs(x.copy_after),
        temperature=_frozen(table.temperature[rows].copy()),
        seeds=_frozen(table.seed[rows].copy()),
        num_prefill_tokens=int(lens[~decode].sum()),
        num_decode_tokens=int(decode.sum()),
        num_hit_tokens=hit_tokens,
        num_query_tokens=query_tokens,
        state_save_before=_pairs(x.state_save_before),
        state_save_within=_within(x.state_save_within, rows),
    )


def _within(saves: list[tuple[int, int, int]], rows: np.ndarray) -> np.ndarray:
    """(batch row, tokens, slot) -> (plan row, tokens, slot)."""
    if not saves:
        return _EMPTY3
    index = {int(r): i for i, r in enumerate(rows.tolist())}
    out = [(index[row], tokens, slot) for row, tokens, slot in saves]
    return _frozen(np.asarray(out, dtype=np.int32).reshape(len(out), 3))
