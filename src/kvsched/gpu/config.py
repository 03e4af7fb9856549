"""``HybridConfig``: the fields of a Qwen3.5 text config the hybrid model uses.

Also the layer-type names (``LINEAR`` for gated-DeltaNet layers, ``FULL`` for gated
full-attention layers) and ``GdnMode``, how multi-token ranges run the gated delta rule.
Plain Python: reading ``config.json`` needs no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

GdnMode = Literal["chunked", "recurrent"]
LINEAR = "linear_attention"
FULL = "full_attention"


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
        """From ``path/config.json``; ``ValueError`` naming the file if it lacks a field."""
        where = Path(path) / "config.json"
        with open(where, encoding="utf-8") as f:
            data = json.load(f)
        try:
            return cls.from_dict(data)
        except KeyError as exc:
            kind = data.get("model_type") if isinstance(data, dict) else None
            raise ValueError(
                f"{where} has no {exc}: not a Qwen3.5-style hybrid config "
                f"(expected model_type qwen3_5_text or qwen3_5, found {kind!r})"
            ) from None

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

    def state_bytes(self, state_itemsize: int = 4, conv_itemsize: int = 2) -> int:
        """One sequence's recurrent state (``ModelSpec.state_bytes``): per linear layer the
        gated-delta state (value heads x key dim x value dim) and the conv state (conv dim x
        kernel - 1)."""
        rec = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        conv = self.conv_dim * (self.linear_conv_kernel_dim - 1)
        return len(self.linear_layers) * (rec * state_itemsize + conv * conv_itemsize)

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """KV of one token over the attention layers (``ModelSpec.kv_bytes_per_token``)."""
        per_layer = 2 * self.num_key_value_heads * self.head_dim * itemsize
        return len(self.attention_layers) * per_layer


__all__ = ["FULL", "LINEAR", "GdnMode", "HybridConfig"]
