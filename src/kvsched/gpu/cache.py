"""``PagedCache``: the hybrid model's paged KV blocks and recurrent-state slots.

One stacked K and one stacked V tensor for the attention layers, one conv-state and one
recurrent-state tensor for the gated-DeltaNet layers, with per-layer views and the
block/slot copy and zero operations an executor applies from a plan. ``release`` frees the
tensors (an executor's sleep), ``allocate`` makes them again, zeroed (its wake).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvsched.gpu.config import HybridConfig


class PagedCache:
    """Paged KV for the attention layers and state slots for the gated-DeltaNet layers.

    ``key[j]``/``value[j]`` (attention layer j) are ``[num_blocks, block_size, kv_heads,
    head_dim]`` views of one stacked tensor; ``conv[j]`` is ``[num_slots, conv_dim, K-1]`` (the
    last K-1 raw ``in_proj_qkv`` outputs) and ``recurrent[j]`` is ``[num_slots, Hv, dk, dv]`` in
    float32 (linear layer j). Block 0 and slot 0 are the null block and slot.
    """

    def __init__(
        self,
        config: HybridConfig,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        *,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.num_blocks, self.block_size, self.num_state_slots = (
            num_blocks,
            block_size,
            num_state_slots,
        )
        self.config, self.device, self.dtype = config, device, dtype
        self.allocate()
        c = config
        self.layer_index = {layer: j for j, layer in enumerate(c.attention_layers)}
        self.layer_index.update({layer: j for j, layer in enumerate(c.linear_layers)})

    def allocate(self) -> None:
        """(Re)create every tensor, zeroed."""
        c, device, dtype = self.config, self.device, self.dtype
        na, nl = len(c.attention_layers), len(c.linear_layers)
        kv_shape = (na, self.num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        self.key_all = torch.zeros(kv_shape, device=device, dtype=dtype)
        self.value_all = torch.zeros(kv_shape, device=device, dtype=dtype)
        k1 = c.linear_conv_kernel_dim - 1
        self.conv_all = torch.zeros(
            (nl, self.num_state_slots, c.conv_dim, k1), device=device, dtype=dtype
        )
        rec_shape = (
            nl,
            self.num_state_slots,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        self.recurrent_all = torch.zeros(rec_shape, device=device, dtype=torch.float32)

    def release(self) -> None:
        """Drop every tensor's memory (empty tensors until ``allocate``)."""
        self.key_all = self.value_all = torch.empty(0, device=self.device, dtype=self.dtype)
        self.conv_all = torch.empty(0, device=self.device, dtype=self.dtype)
        self.recurrent_all = torch.empty(0, device=self.device, dtype=torch.float32)

    @property
    def released(self) -> bool:
        return self.key_all.numel() == 0 and self.recurrent_all.numel() == 0

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        j = self.layer_index[layer]
        return self.key_all[j], self.value_all[j]

    def state(self, layer: int) -> tuple[Tensor, Tensor]:
        j = self.layer_index[layer]
        return self.conv_all[j], self.recurrent_all[j]

    def copy_blocks(self, pairs: Tensor) -> None:
        """Copy KV blocks ``pairs[:, 0] -> pairs[:, 1]`` in every attention layer."""
        if len(pairs):
            src, dst = pairs[:, 0], pairs[:, 1]
            self.key_all[:, dst] = self.key_all[:, src]
            self.value_all[:, dst] = self.value_all[:, src]

    def zero_blocks(self, blocks: Tensor) -> None:
        if len(blocks):
            self.key_all[:, blocks] = 0
            self.value_all[:, blocks] = 0

    def zero_states(self, slots: Tensor) -> None:
        if len(slots):
            self.conv_all[:, slots] = 0
            self.recurrent_all[:, slots] = 0

    def copy_states(self, pairs: Tensor) -> None:
        """Copy conv and recurrent state ``pairs[:, 0] -> pairs[:, 1]`` in every linear layer."""
        if len(pairs):
            src, dst = pairs[:, 0], pairs[:, 1]
            self.conv_all[:, dst] = self.conv_all[:, src]
            self.recurrent_all[:, dst] = self.recurrent_all[:, src]


__all__ = ["PagedCache"]
