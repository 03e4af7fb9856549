"""The state and KV sizes a model's layer shapes give (what a byte budget counts)."""

from __future__ import annotations

from kvsched.config import ModelSpec
from kvsched.gpu.config import FULL, LINEAR, HybridConfig


def test_qwen3_next_80b_shapes_give_the_model_specs_default_state_and_kv_bytes():
    # 48 layers, every fourth full attention: 36 gated-DeltaNet layers, 12 attention layers
    layers = tuple(FULL if i % 4 == 3 else LINEAR for i in range(48))
    cfg = HybridConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
        layer_types=layers, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    )
    spec = ModelSpec()
    assert cfg.state_bytes() == spec.state_bytes == 77_266_944
    assert cfg.kv_bytes_per_token() == spec.kv_bytes_per_token == 24_576
    assert cfg.state_bytes(state_itemsize=2) < cfg.state_bytes()
