"""Pure tensor math of the hybrid model: no modules, no parameters, no cache.

Zero-centred RMSNorm, L2 normalisation, rotate-half for RoPE, and the gated delta rule in
its token-by-token (``gated_delta_recurrent``) and chunked UT-transform
(``gated_delta_chunked``) forms. Plain torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


__all__ = [
    "gated_delta_chunked",
    "gated_delta_recurrent",
    "l2norm",
    "rms_norm_zero_centred",
    "rotate_half",
]
