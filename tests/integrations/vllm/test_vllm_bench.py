"""``kvsched bench vllm``: both call orders time vLLM's scheduler and the adapter side by side."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment (its transformers pin conflicts with the "
    "oracle tests'): scripts/test_vllm.sh builds .venv-vllm and runs `pytest -k vllm` there",
)

from kvsched.integrations.vllm.bench import run_vllm_bench


@pytest.mark.parametrize(
    ("order", "reference"), [("sync", "vllm"), ("async", "vllm-async")], ids=["sync", "async"]
)
def test_vllm_bench_times_vllms_scheduler_and_the_adapter_in_each_call_order(
    order: str, reference: str
):
    rows = run_vllm_bench(running=8, samples=3, rounds=1, order=order)
    assert [row["impl"] for row in rows] == [reference, "kvsched"]
    for row in rows:
        assert row["order"] == order and row["running"] == 8
        assert 0 < row["min_ms"] <= row["p50_ms"] <= row["p99_ms"]
