"""Two engines in two processes share one Mooncake Store (torch executor, tiny model): engine A
serves a prompt and saves its KV (and, for a hybrid model, state checkpoints); engine B, in a
second process with its own client, serves the same prompt, loads the prefix and computes
only the uncached suffix; its tokens equal a cold run's. Select with ``pytest -k mooncake``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def assert_b_served_a_prefix_from_the_store(info: dict[str, Any]) -> None:
    prompt, cold, a, b = info["prompt_tokens"], info["cold"], info["a"], info["b"]
    assert cold["loads"] == 0 and cold["prefill_tokens"] == prompt, cold
    assert a["saves"] >= 1 and a["saves_failed"] == 0, a
    assert a["tokens"] == cold["tokens"], (a, cold)
    assert b["loads"] >= 1 and not b["load_failures"], b
    assert b["prefill_tokens"] < prompt - 100, b
    assert b["external_hit_tokens"] + b["prefill_tokens"] == prompt, b
    assert b["tokens"] == cold["tokens"], (b, cold)


def test_mooncake_engine_b_loads_engine_a_prefix_and_matches_a_cold_run_attention(
    mooncake: Any,
) -> None:
    info = mooncake.run("engines_share_prefix_attention")
    assert_b_served_a_prefix_from_the_store(info)
    assert info["b"]["state_loads"] == 0


def test_mooncake_engine_b_loads_engine_a_prefix_and_state_and_matches_a_cold_run_hybrid(
    mooncake: Any,
) -> None:
    info = mooncake.run("engines_share_prefix_hybrid")
    assert_b_served_a_prefix_from_the_store(info)
    assert info["b"]["state_loads"] >= 1
