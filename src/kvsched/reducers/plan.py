"""StepPlan: the frozen plain-data plan of one step, folded from the step's decisions.

The executor sees only this: which tokens to compute for which sequences, where their KV
lives, which blocks to copy or zero, and how to sample. Arrays are read-only.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvsched.reducers.checkpoints import CheckpointTable
from kvsched.reducers.state import EngineState


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr


@attrs.frozen(kw_only=True)
class StepPlan:
    step: int
    clock: float
    block_size: int
    seq_ids: np.ndarray  # int64 [n]: decodes first, then prefill chunks
    starts: np.ndarray  # int64 [n]: first position computed
    ends: np.ndarray  # int64 [n]: one past the last position computed
    sample: np.ndarray  # bool [n]: sample a token after this sequence's last position
    input_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]: block * block_size + offset of each token's KV
    block_tables: np.ndarray  # int32 [n, max_blocks]; unused entries are the null block 0
    num_blocks: np.ndarray  # int32 [n]: blocks covering [0, end)
    copy_blocks: np.ndarray  # int32 [k, 2]: (src, dst) pairs to copy before the forward
    zero_blocks: np.ndarray  # int32 [k]
    # Hybrid models (all empty / zero for attention-only models). State slot 0 is the null slot.
    state_slots: np.ndarray  # int32 [n]: each sequence's runtime state slot
    state_zero: np.ndarray  # int32 [k]: runtime slots reset to zero before the forward
    state_restore: np.ndarray  # int32 [k, 2]: (checkpoint slot -> runtime slot) before forward
    state_save: np.ndarray  # int32 [k, 2]: (runtime slot -> checkpoint slot) after the forward
    copy_blocks_after: np.ndarray  # int32 [k, 2]: (src, dst) block copies after the forward
    temperature: np.ndarray  # float32 [n]
    seeds: np.ndarray  # int64 [n]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_hit_tokens: int  # prompt tokens served from the prefix cache by this step's admissions
    num_query_tokens: int  # prompt tokens of this step's first admissions

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_empty(self) -> bool:
        return len(self.seq_ids) == 0

    @property
    def kv_tokens_read(self) -> int:
        return int(self.ends.sum())


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    return _frozen(np.asarray(pairs, dtype=np.int32).reshape(len(pairs), 2))


def plan_step(state: EngineState) -> StepPlan:
    """Fold the step's scheduled work (``state.pending``) into a frozen plan."""
    table, bs, x = state.seqs, state.block_size, state.extras
    rows, starts, ends = state.pending.arrays()
    lens = ends - starts
    total = int(lens.sum())
    bounds = np.concatenate(([0], np.cumsum(lens)))
    positions = np.arange(total, dtype=np.int64) - np.repeat(bounds[:-1] - starts, lens)
    token_rows = np.repeat(rows, lens)
    slots = table.table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
    input_ids = np.empty(total, dtype=np.int32)
    decode = (lens == 1) & (starts == table.ntokens[rows] - 1)
    input_ids[bounds[:-1][decode]] = table.last_token[rows[decode]]
    for i in np.nonzero(~decode)[0].tolist():
        seq = state.seq(int(table.row_seq[rows[i]]))
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
        copy_blocks=_pairs([(f, int(table.table[r, i])) for r, i, f in x.restore_blocks]),
        zero_blocks=_frozen(np.zeros(0, dtype=np.int32)),
        state_slots=_frozen(
            CheckpointTable.runtime_slots(rows) if state.hybrid else np.zeros(len(rows), np.int32)
        ),
        state_zero=_frozen(np.asarray(x.state_zero, dtype=np.int32)),
        state_restore=_pairs(x.state_restore),
        state_save=_pairs(x.state_save),
        copy_blocks_after=_pairs(x.copy_after),
        temperature=_frozen(table.temperature[rows].copy()),
        seeds=_frozen(table.seed[rows].copy()),
        num_prefill_tokens=int(lens[~decode].sum()),
        num_decode_tokens=int(decode.sum()),
        num_hit_tokens=state.step_hit_tokens,
        num_query_tokens=state.step_query_tokens,
    )
