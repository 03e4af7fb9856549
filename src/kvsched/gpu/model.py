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

This module holds ``HybridModel`` (RoPE tables, forward, checkpoint loading) and
``count_parameters``; the pieces live in ``config`` (``HybridConfig``), ``batch``
(``BatchInputs``), ``cache`` (``PagedCache``), ``kernels`` (the tensor math) and ``layers``
(the ``nn.Module`` layers). Their public names are re-exported here.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from kvsched.gpu.batch import BatchInputs
from kvsched.gpu.cache import PagedCache
from kvsched.gpu.config import FULL, LINEAR, GdnMode, HybridConfig
from kvsched.gpu.kernels import (
    gated_delta_chunked,
    gated_delta_recurrent,
    l2norm,
    rms_norm_zero_centred,
)
from kvsched.gpu.layers import MLP, Attention, DecoderLayer, GatedDeltaNet, RMSNorm, linear


class _Body(nn.Module):
    """``model.*`` of the checkpoint."""

    def __init__(self, c: HybridConfig, gdn_mode: GdnMode) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, gdn_mode) for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class HybridModel(nn.Module):
    """Qwen3.5-style hybrid causal LM running varlen batches on a :class:`PagedCache`."""

    def __init__(self, config: HybridConfig, gdn_mode: GdnMode = "chunked") -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config, gdn_mode)
        self.lm_head = linear(config.hidden_size, config.vocab_size)
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
        path = Path(path)
        model = cls(HybridConfig.from_pretrained(path), gdn_mode)
        try:
            model.load_hf_state_dict(read_checkpoint(path))
        except CheckpointMismatch as exc:
            found = _model_kind(path)
            raise CheckpointMismatch(
                f"{path} is not a checkpoint of the Qwen3.5-style hybrid its config.json "
                f"describes (expected model_type qwen3_5_text or qwen3_5, found {found}): {exc}"
            ) from None
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
        _check_fits(self.state_dict(), renamed)
        self.load_state_dict(renamed)

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
        norm: RMSNorm = self.model.norm
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


class CheckpointMismatch(ValueError):
    """A checkpoint whose tensors do not fit the model: names missing or unexpected, or
    shapes other than the config's."""


def _check_fits(expected: Mapping[str, Tensor], found: Mapping[str, Tensor]) -> None:
    """One-line :class:`CheckpointMismatch` unless ``found`` has exactly ``expected``'s
    names and shapes (before ``load_state_dict``'s multi-line error)."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    shapes = [
        f"{name} {tuple(found[name].shape)} instead of {tuple(want.shape)}"
        for name, want in expected.items()
        if name in found and found[name].shape != want.shape
    ]
    parts = [
        f"{len(items)} {what} (e.g. {', '.join(items[:3])})"
        for what, items in (
            ("tensors missing", missing),
            ("unexpected tensors", unexpected),
            ("tensors of another shape", shapes),
        )
        if items
    ]
    if parts:
        raise CheckpointMismatch("; ".join(parts))


def _model_kind(path: Path) -> str:
    """``config.json``'s model_type and architectures, for an error message."""
    try:
        with open(path / "config.json", encoding="utf-8") as f:
            data = json.load(f)
        return f"{data.get('model_type')!r} {data.get('architectures') or ''}".strip()
    except (OSError, ValueError, AttributeError):
        return "an unreadable config.json"


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path`` (Hugging Face names), on CPU."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def count_parameters(model: nn.Module) -> int:
    return sum(math.prod(p.shape) for p in model.parameters())


__all__: Sequence[str] = [
    "FULL",
    "LINEAR",
    "MLP",
    "Attention",
    "BatchInputs",
    "CheckpointMismatch",
    "DecoderLayer",
    "GatedDeltaNet",
    "GdnMode",
    "HybridConfig",
    "HybridModel",
    "PagedCache",
    "count_parameters",
    "gated_delta_chunked",
    "gated_delta_recurrent",
    "l2norm",
    "read_checkpoint",
    "rms_norm_zero_centred",
]
