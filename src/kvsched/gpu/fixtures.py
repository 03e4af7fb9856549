"""A tiny Qwen3.5-style hybrid model with seeded random weights, for tests and benchmarks.

``build_tiny_model(path)`` writes a Hugging Face checkpoint (``config.json`` +
``model.safetensors``, fp32) that both ``transformers.Qwen3_5ForCausalLM`` and
``kvsched.gpu.model.HybridModel`` load. Needs ``torch`` and ``transformers==5.24.0``.

The weights are chosen so that oracle tests are sensitive (see
``shared/notes/feasibility.md`` section 2): ``initializer_range`` 0.1, gated-DeltaNet decay
``A_log`` re-drawn from log U(0.001, 0.05) so heads keep a long memory, and the norm weights,
``dt_bias`` and the gated-norm weight perturbed away from their constant initial values so a
wrong norm convention changes the logits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": [
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "max_position_embeddings": 65536,
    "initializer_range": 0.1,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def build_tiny_model(
    path: str | os.PathLike[str], seed: int = 0, **overrides: Any
) -> tuple[Path, Any]:
    """Write a seeded tiny ``Qwen3_5ForCausalLM`` to ``path``; return (path, config).

    ``overrides`` replace entries of :data:`TINY_CONFIG` (for example ``num_hidden_layers=8``
    together with a matching ``layer_types``).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)  # float32: the torch default dtype
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                a = torch.empty(param.shape).uniform_(0.001, 0.05, generator=gen)
                param.copy_(a.log())
            elif name.endswith("dt_bias"):
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=gen))
            elif name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("norm.weight"):  # zero-centred RMSNorms: x * (1 + w)
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out, config
