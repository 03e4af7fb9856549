"""Hand-built StepPlans for the torch executor tests, computed as ``reducers/planner.py`` does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvsched.plan import StepPlan


def _ro(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr


@dataclass
class SeqSpec:
    """One sequence's work in a step: compute ``tokens[start:end]`` into ``blocks``."""

    seq_id: int
    tokens: Sequence[int]  # every token of the sequence known so far
    start: int
    end: int
    blocks: Sequence[int]  # the sequence's block table (at least ceil(end / block_size))
    slot: int = 0  # runtime state slot
    sample: bool | None = None  # default: end == len(tokens)
    temperature: float = 0.0
    seed: int = 0
    extra: dict[str, object] = field(default_factory=dict)


def make_plan(
    specs: Sequence[SeqSpec],
    block_size: int,
    *,
    step: int = 0,
    copy_blocks: Sequence[tuple[int, int]] = (),
    zero_blocks: Sequence[int] = (),
    state_zero: Sequence[int] = (),
    state_restore: Sequence[tuple[int, int]] = (),
    state_save: Sequence[tuple[int, int]] = (),
    copy_blocks_after: Sequence[tuple[int, int]] = (),
    state_save_before: Sequence[tuple[int, int]] = (),
    state_save_within: Sequence[tuple[int, int, int]] = (),
) -> StepPlan:
    """A valid StepPlan for ``specs`` (in plan order). ``state_save_within`` triples are
    (plan row, tokens p, checkpoint slot)."""
    bs = block_size
    starts = np.array([s.start for s in specs], dtype=np.int64)
    ends = np.array([s.end for s in specs], dtype=np.int64)
    ntokens = np.array([len(s.tokens) for s in specs], dtype=np.int64)
    lens = ends - starts
    assert (lens >= 1).all() and (ends <= ntokens).all()
    positions = np.concatenate(
        [np.arange(s.start, s.end, dtype=np.int64) for s in specs] or [np.zeros(0, np.int64)]
    )
    input_ids = np.concatenate(
        [np.asarray(s.tokens[s.start : s.end], dtype=np.int32) for s in specs]
        or [np.zeros(0, np.int32)]
    ).astype(np.int32)
    nblocks = -(-ends // bs)
    width = int(nblocks.max()) if len(nblocks) else 0
    tables = np.zeros((len(specs), width), dtype=np.int32)
    slots: list[np.ndarray] = []
    for i, s in enumerate(specs):
        blocks = np.asarray(s.blocks, dtype=np.int64)
        assert len(blocks) >= nblocks[i], "block table too short"
        tables[i, : nblocks[i]] = blocks[: nblocks[i]]
        pos = np.arange(s.start, s.end, dtype=np.int64)
        slots.append(blocks[pos // bs] * bs + pos % bs)
    slot_mapping = np.concatenate(slots or [np.zeros(0, np.int64)]).astype(np.int64)
    sample = np.array(
        [s.end == len(s.tokens) if s.sample is None else s.sample for s in specs], dtype=bool
    )
    decode = (lens == 1) & (starts == ntokens - 1)

    def pairs(p: Sequence[tuple[int, int]]) -> np.ndarray:
        return _ro(np.asarray(p, dtype=np.int32).reshape(-1, 2))

    def ids(p: Sequence[int]) -> np.ndarray:
        return _ro(np.asarray(p, dtype=np.int32).reshape(-1))

    return StepPlan(
        step=step,
        clock=0.0,
        block_size=bs,
        seq_ids=_ro(np.array([s.seq_id for s in specs], dtype=np.int64)),
        starts=_ro(starts),
        ends=_ro(ends),
        sample=_ro(sample),
        input_ids=_ro(input_ids),
        positions=_ro(positions),
        slot_mapping=_ro(slot_mapping),
        block_tables=_ro(tables),
        num_blocks=_ro(nblocks.astype(np.int32)),
        copy_blocks=pairs(copy_blocks),
        zero_blocks=ids(zero_blocks),
        state_slots=_ro(np.array([s.slot for s in specs], dtype=np.int32)),
        state_zero=ids(state_zero),
        state_restore=pairs(state_restore),
        state_save=pairs(state_save),
        copy_blocks_after=pairs(copy_blocks_after),
        temperature=_ro(np.array([s.temperature for s in specs], dtype=np.float32)),
        seeds=_ro(np.array([s.seed for s in specs], dtype=np.int64)),
        num_prefill_tokens=int(lens[~decode].sum()),
        num_decode_tokens=int(decode.sum()),
        num_hit_tokens=0,
        num_query_tokens=0,
        state_save_before=pairs(state_save_before),
        state_save_within=_ro(np.asarray(state_save_within, dtype=np.int32).reshape(-1, 3)),
    )
