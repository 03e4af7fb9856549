"""plan_step: the fold of one step's scheduled work and copies into a frozen ``StepPlan``.

Reads the sequence table (the work scheduled this step, block tables, tokens, sampling
parameters) and the step's extras (``StepWork``); returns read-only arrays.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvsched.plan import StepPlan
from kvsched.reducers.checkpoints import CheckpointTable
from kvsched.reducers.drafts import within_runs
from kvsched.reducers.state import EngineState

# StepPlan's array fields (made read-only once the plan is built)
_ARRAYS = tuple(f.name for f in attrs.fields(StepPlan) if f.type in (np.ndarray, "np.ndarray"))
# shared, read-only: most steps copy, zero and save nothing
_NONE = np.zeros(0, dtype=np.int32)
_NO_PAIRS = np.zeros((0, 2), dtype=np.int32)
_NO_TRIPLES = np.zeros((0, 3), dtype=np.int32)
for _empty in (_NONE, _NO_PAIRS, _NO_TRIPLES):
    _empty.setflags(write=False)


def plan_step(state: EngineState) -> StepPlan:
    """Fold the step's scheduled work (``SequenceTable.pending_arrays``) and copies
    (``StepWork.extras``) into a plan whose arrays are read-only."""
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
    known = table.planned_known(rows)  # (overlapped steps: placeholders too)
    decode = starts == known - 1  # (its newest token, and any drafts)
    newest = table.last_token[rows[decode]]
    if table.pipelined:  # a placeholder's token is the executor's own from the step before
        newest = np.where(table.ahead[rows[decode]] > 0, -1, newest)
    input_ids[bounds[:-1][decode]] = newest
    for i in np.nonzero(~decode)[0].tolist():
        seq = state.seqs.seq(int(table.row_seq[rows[i]]))
        input_ids[bounds[i] : bounds[i + 1]] = seq.tokens[starts[i] : ends[i]]
    num_drafts = _NONE
    if table.any_verifying:  # (each verified draft follows its row's newest token)
        num_drafts = table.verifying_of(rows)
        after = np.repeat(bounds[:-1] + 1, num_drafts) + within_runs(num_drafts)
        input_ids[after] = table.draft_tokens(rows, num_drafts)
    nblocks = -(-ends // bs)
    lookahead = state.config.speculation.lookahead  # (an EAGLE drafter writes past the work)
    if lookahead:
        covered = np.minimum(ends + lookahead, state.config.model.max_context)
        nblocks = np.minimum(-(-covered // bs), table.nblocks[rows])
    width = int(nblocks.max()) if len(nblocks) else 0
    tables = table.table[rows, :width]  # entries past a row's blocks are kept zero
    restored = [(f, int(table.table[r, i])) for r, i, f in x.restore_blocks]
    pairs = []  # (from, to): block copies before and after the forward, state restores, saves
    for p in (
        x.copy_before + restored, x.copy_after, x.state_restore, x.state_save, x.state_save_before
    ):
        pairs.append(np.array(p, dtype=np.int32).reshape(-1, 2) if p else _NO_PAIRS)
    copies, copies_after, restores, saves, saves_before = pairs
    within = _NO_TRIPLES  # mid-chunk saves: (batch row, tokens, slot) -> (plan row, ...)
    if x.state_save_within:
        index = {r: i for i, r in enumerate(rows.tolist())}
        triples = [(index[row], tokens, slot) for row, tokens, slot in x.state_save_within]
        within = np.array(triples, dtype=np.int32)
    plan = StepPlan(
        step=state.step,
        clock=state.clock,
        block_size=bs,
        seq_ids=table.row_seq[rows],
        starts=starts,
        ends=ends,
        sample=ends >= known,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        block_tables=tables,
        num_blocks=nblocks.astype(np.int32),
        copy_blocks=copies,
        zero_blocks=_NONE,
        state_slots=(
            CheckpointTable.runtime_slots(rows) if state.hybrid else np.zeros(len(rows), np.int32)
        ),
        state_zero=np.array(x.state_zero, dtype=np.int32) if x.state_zero else _NONE,
        state_restore=restores,
        state_save=saves,
        copy_blocks_after=copies_after,
        temperature=table.temperature[rows],
        seeds=table.seed[rows],
        num_prefill_tokens=int(lens[~decode].sum()),
        num_decode_tokens=int(lens[decode].sum()),
        num_hit_tokens=hit_tokens,
        num_query_tokens=query_tokens,
        state_save_before=saves_before,
        state_save_within=within,
        num_drafts=num_drafts,
    )
    for name in _ARRAYS:
        getattr(plan, name).setflags(write=False)
    return plan
