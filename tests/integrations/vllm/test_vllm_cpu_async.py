"""``cpu_async``: vLLM's async scheduling kept on for its CPU build, and only there (the
end-to-end runs under it are in test_vllm_scheduler.py and the feature tests)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment (its transformers pin conflicts with the "
    "oracle tests'): scripts/test_vllm.sh builds .venv-vllm and runs `pytest -k vllm` there",
)

import torch
from vllm.platforms import cpu, current_platform

from kvsched.integrations.vllm.cpu_async import keep_async_scheduling_on_cpu

PATCHED = [(torch.cuda, "Event"), (torch.cuda, "Stream"), (torch.cuda, "current_stream"),
           (torch.cuda, "stream"), (cpu.CpuPlatform, "check_and_update_config")]  # fmt: skip


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[object, str], object]:
    """What the patch may touch, as it is now; put back after the test."""
    before = {}
    for owner, name in PATCHED:
        before[owner, name] = owner.__dict__[name]
        monkeypatch.setattr(owner, name, owner.__dict__[name])
    monkeypatch.delattr(cpu.CpuPlatform, "_kvsched_keeps_async", raising=False)
    return before


def test_vllm_cpu_async_patches_nothing_where_vllm_does_not_run_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, restored: dict[tuple[object, str], object]
):
    """On a GPU, vLLM runs async scheduling itself and its CUDA events must stay real."""
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    keep_async_scheduling_on_cpu()
    assert all(owner.__dict__[name] is restored[owner, name] for owner, name in PATCHED)


def test_vllm_cpu_async_on_the_cpu_stubs_the_output_copys_stream_and_event(
    restored: dict[tuple[object, str], object],
):
    assert current_platform.is_cpu()
    keep_async_scheduling_on_cpu()
    changed = [name for owner, name in PATCHED if owner.__dict__[name] is not restored[owner, name]]
    assert changed == [name for _, name in PATCHED]
    event = torch.cuda.Event(blocking=True)
    event.record()
    event.synchronize()  # (no CUDA: a no-op)
    with torch.cuda.stream(torch.cuda.Stream()):
        pass
