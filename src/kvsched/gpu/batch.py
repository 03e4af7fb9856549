"""``BatchInputs``: one varlen forward's inputs on the model's device.

Built from plan-shaped numpy arrays (token ids, positions, KV slot mapping, each sequence's
``[start, end)``, block table and state slot). Sequences computing one token and sequences
computing several tokens form two ``_Group`` s, each with its padded gather indices, token
mask, KV gather indices and causal in-range attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class _Group:
    """Sequences of one kind (single-token or multi-token) with their gather indices."""

    seqs: Tensor  # int64 [g]: indices into the batch's sequences
    token_index: Tensor  # int64 [g, Lq]: token rows in the flat batch (padding: 0)
    token_mask: Tensor  # bool [g, Lq]: real tokens
    kv_index: Tensor  # int64 [g, Lk]: flat KV slots of positions [0, Lk) (padding: 0)
    attn_mask: Tensor  # bool [g, 1, Lq, Lk]: causal and in range
    slots: Tensor  # int64 [g]: state slots
    lengths: list[int]  # tokens per sequence
    lengths_t: Tensor  # int64 [g]: the same, on the device

    @property
    def size(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True)
class BatchInputs:
    """One forward's inputs on the model's device, built from plan-shaped arrays."""

    input_ids: Tensor  # int64 [T]
    positions: Tensor  # int64 [T]
    slot_mapping: Tensor  # int64 [T]
    single: _Group  # sequences computing one token
    multi: _Group  # sequences computing several tokens
    num_seqs: int

    @classmethod
    def build(
        cls,
        *,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        block_tables: np.ndarray,
        state_slots: np.ndarray,
        block_size: int,
        device: torch.device,
    ) -> BatchInputs:
        starts = np.asarray(starts, dtype=np.int64)
        ends = np.asarray(ends, dtype=np.int64)
        lens = ends - starts
        offsets = np.concatenate(([0], np.cumsum(lens)))
        tables = np.asarray(block_tables, dtype=np.int64)
        slots = np.asarray(state_slots, dtype=np.int64)

        def group(mask: np.ndarray) -> _Group:
            idx = np.nonzero(mask)[0]
            g = len(idx)
            lq = int(lens[idx].max()) if g else 0
            lk = int(ends[idx].max()) if g else 0
            q_off = np.arange(lq, dtype=np.int64)
            token_mask = q_off[None, :] < lens[idx, None]
            token_index = np.where(token_mask, offsets[idx, None] + q_off[None, :], 0)
            k_pos = np.arange(lk, dtype=np.int64)
            in_range = k_pos[None, :] < ends[idx, None]
            cols = np.minimum(k_pos // block_size, max(tables.shape[1] - 1, 0))
            blk = tables[idx][:, cols] if g else np.zeros((0, lk), dtype=np.int64)
            kv_index = np.where(in_range, blk * block_size + k_pos % block_size, 0)
            q_pos = starts[idx, None] + q_off[None, :]  # [g, Lq]
            attn = (k_pos[None, None, :] <= q_pos[:, :, None]) & in_range[:, None, :]
            if lk:
                attn[:, :, 0] |= ~token_mask  # padded query rows attend to something (discarded)

            def t(a: np.ndarray) -> Tensor:
                return torch.from_numpy(np.ascontiguousarray(a)).to(device)

            return _Group(
                seqs=t(idx.astype(np.int64)),
                token_index=t(token_index),
                token_mask=t(token_mask),
                kv_index=t(kv_index),
                attn_mask=t(attn[:, None]),
                slots=t(slots[idx]),
                lengths=[int(x) for x in lens[idx]],
                lengths_t=t(lens[idx]),
            )

        def t1(a: np.ndarray) -> Tensor:
            return torch.from_numpy(np.asarray(a, dtype=np.int64).copy()).to(device)

        return cls(
            input_ids=t1(input_ids),
            positions=t1(positions),
            slot_mapping=t1(slot_mapping),
            single=group(lens == 1),
            multi=group(lens > 1),
            num_seqs=len(lens),
        )


__all__ = ["BatchInputs"]
