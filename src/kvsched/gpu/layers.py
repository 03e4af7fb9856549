"""The hybrid model's ``nn.Module`` layers, named as in the Hugging Face checkpoint.

``RMSNorm`` (zero-centred), the gated per-head norm of the DeltaNet output, the SwiGLU
``MLP``, gated full ``Attention`` on paged KV, ``GatedDeltaNet`` on per-sequence state slots,
and the ``DecoderLayer`` that wraps one of the two mixers with its norms and MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvsched.gpu.batch import BatchInputs
from kvsched.gpu.cache import PagedCache
from kvsched.gpu.config import LINEAR, GdnMode, HybridConfig
from kvsched.gpu.kernels import (
    gated_delta_chunked,
    gated_delta_recurrent,
    l2norm,
    rms_norm_zero_centred,
    rotate_half,
)


def linear(in_f: int, out_f: int) -> nn.Linear:
    return nn.Linear(in_f, out_f, bias=False)


class RMSNorm(nn.Module):
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
        self.gate_proj = linear(c.hidden_size, c.intermediate_size)
        self.up_proj = linear(c.hidden_size, c.intermediate_size)
        self.down_proj = linear(c.intermediate_size, c.hidden_size)

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
        self.q_proj = linear(c.hidden_size, self.heads * self.head_dim * 2)
        self.k_proj = linear(c.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = linear(c.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = linear(self.heads * self.head_dim, c.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.rotary_dim = c.rotary_dim

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        r = self.rotary_dim
        rot = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
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
        self.in_proj_qkv = linear(c.hidden_size, self.conv_dim)
        self.in_proj_z = linear(c.hidden_size, self.value_dim)
        self.in_proj_b = linear(c.hidden_size, self.hv)
        self.in_proj_a = linear(c.hidden_size, self.hv)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = _GatedNorm(self.dv, c.rms_norm_eps)
        self.out_proj = linear(self.value_dim, c.hidden_size)

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
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

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


__all__ = [
    "MLP",
    "Attention",
    "DecoderLayer",
    "GatedDeltaNet",
    "RMSNorm",
    "linear",
]
