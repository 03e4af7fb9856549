"""A Qwen3.5-style hybrid language model on paged KV blocks and recurrent-state slots.

The architecture is the dense Qwen3.5 text model (``transformers`` ``Qwen3_5ForCausalLM``):

* gated-DeltaNet layers (``layer_types == "linear_attention"``): depthwise causal conv over
  ``in_proj_qkv``, SiLU, L2-normalised q/k, the gated delta rule
  ``S <- S*exp(g); S <- S + k (x) beta*(v - k^T S); o = q^T S``, a per-head RMSNorm gated by
  ``silu(z)`` and ``out_proj``;
* gated full-attention layers (``"full_attention"``): ``q_proj`` yields (q, gate), zero-centred
  RMSNorm on q and k per head, partial rotate-half RoPE, causal GQA, output x sigmoid(gate);
* zero-centred RMSNorms (``x_hat * (1 + w)``), SwiGLU MLP, final norm, untied ``lm_head``.

Weights load from a Hugging Face safetensors checkpoint with the Hugging Face parameter
names. No custom kernels: everything is plain torch.

One forward runs a varlen batch: the concatenated token ranges of several sequences, each
either a single token (a decode, or a one-token chunk) or a prefill chunk. Attention layers
write the new tokens' K/V into paged per-layer tensors at ``slot_mapping`` and read
``[0, end)`` of each sequence through its block table. Gated-DeltaNet layers read each
sequence's conv and recurrent state from its state slot, advance it over the sequence's
tokens, and write it back. Single-token sequences are batched (one vectorised recurrent
step); multi-token sequences are padded into one batch and run through the chunked form of
the gated delta rule (exact up to fp32 rounding; ``gdn_mode="recurrent"`` runs the plain
token-by-token recurrence instead).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

GdnMode = Literal["chunked", "recurrent"]
LINEAR = "linear_attention"
FULL = "full_attention"


# ------------------------------------------------------------------------------ config


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """The fields of a ``Qwen3_5TextConfig`` this model uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types must have one entry per layer")
        if any(t not in (LINEAR, FULL) for t in self.layer_types):
            raise ValueError(f"unsupported layer types {set(self.layer_types)}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported activation {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HybridConfig:
        """From a ``config.json`` dict (a text config, or a multimodal one with ``text_config``)."""
        if "text_config" in data and isinstance(data["text_config"], Mapping):
            data = data["text_config"]
        rope = dict(data.get("rope_parameters") or {})
        n = int(data["num_hidden_layers"])
        layer_types = data.get("layer_types")
        if layer_types is None:
            interval = int(data.get("full_attention_interval", 4))
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
        hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
        return cls(
            vocab_size=int(data["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(data["intermediate_size"]),
            num_hidden_layers=n,
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=int(data["num_key_value_heads"]),
            head_dim=int(data.get("head_dim") or hidden // heads),
            linear_conv_kernel_dim=int(data.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(data.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(data.get("linear_value_head_dim", 128)),
            linear_num_key_heads=int(data.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(data.get("linear_num_value_heads", 32)),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 0.25))
            ),
            hidden_act=str(data.get("hidden_act", "silu")),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> HybridConfig:
        with open(Path(path) / "config.json", encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def conv_dim(self) -> int:
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


# ------------------------------------------------------------------------------ batch


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


# ------------------------------------------------------------------------------ cache


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
        c = config
        na, nl = len(c.attention_layers), len(c.linear_layers)
        kv_shape = (na, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.key_all = torch.zeros(kv_shape, device=device, dtype=dtype)
        self.value_all = torch.zeros(kv_shape, device=device, dtype=dtype)
        k1 = c.linear_conv_kernel_dim - 1
        self.conv_all = torch.zeros(
            (nl, num_state_slots, c.conv_dim, k1), device=device, dtype=dtype
        )
        rec_shape = (
            nl,
            num_state_slots,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        self.recurrent_all = torch.zeros(rec_shape, device=device, dtype=torch.float32)
        self.layer_index = {layer: j for j, layer in enumerate(c.attention_layers)}
        self.layer_index.update({layer: j for j, layer in enumerate(c.linear_layers)})

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


# ------------------------------------------------------------------------------ math


def rms_norm_zero_centred(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x_hat * (1 + w)`` in float32, cast back (Qwen3.5's RMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule.

    q, k: [B, L, H, dk] (normalised, q scaled); v: [B, L, H, dv]; g, beta: [B, L, H];
    state: [B, H, dk, dv] float32. Returns (out [B, L, H, dv] float32, final state).
    """
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    s = state
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kv_mem = (s * k[:, t, :, :, None]).sum(dim=-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (s * q[:, t, :, :, None]).sum(dim=-2)
    return out, s


def gated_delta_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunked (WY / UT-transform) gated delta rule; same contract as the recurrent form.

    Padding at the end of a sequence with ``beta = 0, g = 0, k = 0`` leaves the final state
    unchanged, so sequences of different lengths can share one padded batch.
    """
    b, length, h, _ = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk_size
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))  # [B, H, Lp, d]
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)) for x in (g, beta))  # [B, H, Lp]
    n = (length + pad) // chunk_size
    q, k, v = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g = g.reshape(b, h, n, chunk_size).cumsum(-1)  # cumulative log-decay inside each chunk
    beta = beta.reshape(b, h, n, chunk_size)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # (I + strict_lower(diag(beta) K K^T * decay)) U = beta V; W likewise for the state read.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * g.exp()[..., None], upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay  # lower triangle including the diagonal
    q_dec = q * g.exp()[..., None]
    k_dec = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty((b, h, n, chunk_size, dv), dtype=torch.float32, device=q.device)
    s = state
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s
        out[:, :, i] = q_dec[:, :, i] @ s + attn[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, n * chunk_size, dv)[:, :, :length].transpose(1, 2)
    return out, s


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ------------------------------------------------------------------------------ layers


def _linear(in_f: int, out_f: int) -> nn.Linear:
    return nn.Linear(in_f, out_f, bias=False)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm_zero_centred(x, self.weight, self.eps)


class _GatedNorm(nn.Module):
    """Per-head RMSNorm (plain weight), then x silu(gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


class MLP(nn.Module):
    def __init__(self, c: HybridConfig) -> None:
        super().__init__()
        self.gate_proj = _linear(c.hidden_size, c.intermediate_size)
        self.up_proj = _linear(c.hidden_size, c.intermediate_size)
        self.down_proj = _linear(c.intermediate_size, c.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        h: Tensor = F.silu(self.gate_proj(x)) * self.up_proj(x)
        out: Tensor = self.down_proj(h)
        return out


class Attention(nn.Module):
    """Gated full attention on paged KV."""

    def __init__(self, c: HybridConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_proj = _linear(c.hidden_size, self.heads * self.head_dim * 2)
        self.k_proj = _linear(c.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = _linear(c.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = _linear(self.heads * self.head_dim, c.hidden_size)
        self.q_norm = _RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = _RMSNorm(self.head_dim, c.rms_norm_eps)
        self.rotary_dim = c.rotary_dim

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        r = self.rotary_dim
        rot = x[..., :r] * cos + _rotate_half(x[..., :r]) * sin
        return torch.cat((rot, x[..., r:]), dim=-1)

    def forward(
        self, x: Tensor, batch: BatchInputs, cache: PagedCache, rope: tuple[Tensor, Tensor]
    ) -> Tensor:
        t = x.shape[0]
        hd = self.head_dim
        qg = self.q_proj(x).view(t, self.heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, self.heads * hd)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.kv_heads, hd))
        v = self.v_proj(x).view(t, self.kv_heads, hd)
        cos, sin = rope[0][:, None, :], rope[1][:, None, :]
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        key_cache, value_cache = cache.kv(self.layer)
        flat_k = key_cache.view(-1, self.kv_heads, hd)
        flat_v = value_cache.view(-1, self.kv_heads, hd)
        flat_k[batch.slot_mapping] = k.to(flat_k.dtype)
        flat_v[batch.slot_mapping] = v.to(flat_v.dtype)
        out = torch.zeros((t, self.heads, hd), dtype=q.dtype, device=q.device)
        for grp in (batch.single, batch.multi):
            if not grp.size:
                continue
            qs = q[grp.token_index].transpose(1, 2)  # [g, H, Lq, hd]
            ks = flat_k[grp.kv_index].transpose(1, 2).to(q.dtype)  # [g, Hkv, Lk, hd]
            vs = flat_v[grp.kv_index].transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=grp.attn_mask, scale=hd**-0.5, enable_gqa=True
            ).transpose(1, 2)  # [g, Lq, H, hd]
            out[grp.token_index[grp.token_mask]] = o[grp.token_mask]
        o_flat = out.reshape(t, self.heads * hd) * torch.sigmoid(gate)
        res: Tensor = self.o_proj(o_flat)
        return res


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet on per-sequence state slots."""

    def __init__(self, c: HybridConfig, layer: int, gdn_mode: GdnMode = "chunked") -> None:
        super().__init__()
        self.layer = layer
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = c.conv_dim
        self.kernel = c.linear_conv_kernel_dim
        self.gdn_mode: GdnMode = gdn_mode
        self.in_proj_qkv = _linear(c.hidden_size, self.conv_dim)
        self.in_proj_z = _linear(c.hidden_size, self.value_dim)
        self.in_proj_b = _linear(c.hidden_size, self.hv)
        self.in_proj_a = _linear(c.hidden_size, self.hv)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = _GatedNorm(self.dv, c.rms_norm_eps)
        self.out_proj = _linear(self.value_dim, c.hidden_size)

    def _conv(self, mixed: Tensor, batch: BatchInputs, conv_state: Tensor) -> Tensor:
        """Depthwise causal conv + SiLU of each sequence's tokens, continuing its conv state."""
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        k1 = self.kernel - 1
        out = torch.empty_like(mixed)
        for grp in (batch.single, batch.multi):
            if not grp.size:
                continue
            lq = grp.token_index.shape[1]
            x = mixed[grp.token_index]  # [g, Lq, C]
            if lq > 1:
                x = x * grp.token_mask[..., None]
            window = torch.cat((conv_state[grp.slots], x.transpose(1, 2).to(conv_state.dtype)), -1)
            w = window.to(weight.dtype)
            y = w[:, :, 0:lq] * weight[None, :, 0:1]
            for j in range(1, self.kernel):
                y = y + w[:, :, j : j + lq] * weight[None, :, j : j + 1]  # [g, C, Lq]
            y = F.silu(y).transpose(1, 2).to(out.dtype)  # [g, Lq, C]
            if lq == 1:
                out[grp.token_index[:, 0]] = y[:, 0]
                conv_state[grp.slots] = window[:, :, 1:]
            else:
                out[grp.token_index[grp.token_mask]] = y[grp.token_mask]
                # new state: the K-1 columns ending at each sequence's last token
                cols = grp.lengths_t[:, None] + torch.arange(k1, device=mixed.device)[None, :]
                conv_state[grp.slots] = window.gather(
                    2, cols[:, None, :].expand(-1, self.conv_dim, -1)
                )
        return out

    def forward(self, x: Tensor, batch: BatchInputs, cache: PagedCache) -> Tensor:
        t = x.shape[0]
        conv_state, rec_state = cache.state(self.layer)
        mixed = self._conv(self.in_proj_qkv(x), batch, conv_state)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.hv // self.hk
        q = q.reshape(t, self.hk, self.dk).float()
        k = k.reshape(t, self.hk, self.dk).float()
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        q = l2norm(q) * self.dk**-0.5
        k = l2norm(k)
        v = v.reshape(t, self.hv, self.dv).float()
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        core = torch.empty((t, self.hv, self.dv), dtype=torch.float32, device=x.device)
        for grp in (batch.single, batch.multi):
            if not grp.size:
                continue
            m = grp.token_mask
            idx = grp.token_index
            qs, ks, vs, gs, bs = q[idx], k[idx], v[idx], g[idx], beta[idx]
            if idx.shape[1] > 1:  # zero the padding: no decay, no update
                mf = m[..., None].float()
                qs, ks, gs, bs = qs * mf[..., None], ks * mf[..., None], gs * mf, bs * mf
            s0 = rec_state[grp.slots]
            if grp.token_index.shape[1] == 1 or self.gdn_mode == "recurrent":
                o, s1 = gated_delta_recurrent(qs, ks, vs, gs, bs, s0)
            else:
                o, s1 = gated_delta_chunked(qs, ks, vs, gs, bs, s0)
            rec_state[grp.slots] = s1
            core[idx[m]] = o[m]
        z = self.in_proj_z(x).reshape(t, self.hv, self.dv)
        y = self.norm(core.to(x.dtype), z).reshape(t, self.value_dim)
        res: Tensor = self.out_proj(y)
        return res


class DecoderLayer(nn.Module):
    def __init__(self, c: HybridConfig, layer: int, gdn_mode: GdnMode) -> None:
        super().__init__()
        self.is_linear = c.layer_types[layer] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(c, layer, gdn_mode)
        else:
            self.self_attn = Attention(c, layer)
        self.mlp = MLP(c)
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self, x: Tensor, batch: BatchInputs, cache: PagedCache, rope: tuple[Tensor, Tensor]
    ) -> Tensor:
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.linear_attn(h, batch, cache)
        else:
            h = self.self_attn(h, batch, cache, rope)
        x = x + h
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class _Body(nn.Module):
    """``model.*`` of the checkpoint."""

    def __init__(self, c: HybridConfig, gdn_mode: GdnMode) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, gdn_mode) for i in range(c.num_hidden_layers)
        )
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)


class HybridModel(nn.Module):
    """Qwen3.5-style hybrid causal LM running varlen batches on a :class:`PagedCache`."""

    def __init__(self, config: HybridConfig, gdn_mode: GdnMode = "chunked") -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config, gdn_mode)
        self.lm_head = _linear(config.hidden_size, config.vocab_size)
        rd = config.rotary_dim
        self._inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
        )

    def _gdn_layers(self) -> list[GatedDeltaNet]:
        return [m for m in self.modules() if isinstance(m, GatedDeltaNet)]

    @property
    def gdn_mode(self) -> GdnMode:
        """How multi-token ranges run the gated delta rule: "chunked" or "recurrent"."""
        layers = self._gdn_layers()
        return layers[0].gdn_mode if layers else "chunked"

    @gdn_mode.setter
    def gdn_mode(self, mode: GdnMode) -> None:
        if mode not in ("chunked", "recurrent"):
            raise ValueError(f"unknown gdn_mode {mode!r}")
        for layer in self._gdn_layers():
            layer.gdn_mode = mode

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        gdn_mode: GdnMode = "chunked",
    ) -> HybridModel:
        """Load ``config.json`` and ``*.safetensors`` (Hugging Face names) from ``path``."""
        from safetensors.torch import load_file

        path = Path(path)
        model = cls(HybridConfig.from_pretrained(path), gdn_mode)
        state: dict[str, Tensor] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        for file in files:
            state.update(load_file(str(file)))
        model.load_hf_state_dict(state)
        return model.to(device=device, dtype=dtype).eval()

    def load_hf_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Load Hugging Face tensors (``model.*``, ``lm_head.weight``; ``model.language_model.*``
        of multimodal checkpoints is accepted; ``mtp.*`` and ``model.visual.*`` are ignored)."""
        renamed: dict[str, Tensor] = {}
        for name, tensor in state.items():
            if name.startswith(("mtp.", "model.visual.")):
                continue
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model.") :]
            renamed[name] = tensor
        if self.config.tie_word_embeddings and "lm_head.weight" not in renamed:
            renamed["lm_head.weight"] = renamed["model.embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(renamed, strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.no_grad()
    def forward(self, batch: BatchInputs, cache: PagedCache, logits_index: Tensor) -> Tensor:
        """Run the batch; return float32 logits of the tokens ``logits_index`` (flat rows)."""
        x: Tensor = self.model.embed_tokens(batch.input_ids)
        rope = self.rope(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, batch, cache, rope)
        norm: _RMSNorm = self.model.norm
        h = rms_norm_zero_centred(x[logits_index], norm.weight, norm.eps)
        logits: Tensor = self.lm_head(h)
        return logits.float()

    def make_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        dtype: torch.dtype | None = None,
    ) -> PagedCache:
        p = next(self.parameters())
        return PagedCache(
            self.config,
            num_blocks,
            block_size,
            num_state_slots,
            device=p.device,
            dtype=dtype or p.dtype,
        )


def count_parameters(model: nn.Module) -> int:
    return sum(math.prod(p.shape) for p in model.parameters())


__all__: Sequence[str] = [
    "BatchInputs",
    "HybridConfig",
    "HybridModel",
    "PagedCache",
    "count_parameters",
    "gated_delta_chunked",
    "gated_delta_recurrent",
]
