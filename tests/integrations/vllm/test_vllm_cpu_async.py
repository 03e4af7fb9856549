"""``cpu_async``: vLLM's async scheduling kept on for its CPU build, and only there (the
end-to-end runs under it are in test_vllm_scheduler.py and the feature tests)."""

from __future__ import annotations

from collections.abc import Iterator

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
           (torch.cuda, "stream"), (torch, "zeros"), (torch.Tensor, "pin_memory"),
           (cpu.CpuPlatform, "check_and_update_config")]  # fmt: skip


ABSENT = object()  # (inherited: ``torch.Tensor.pin_memory`` is ``TensorBase``'s)


def _own(owner: object, name: str) -> object:
    return owner.__dict__.get(name, ABSENT)


@pytest.fixture
def restored(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[dict[tuple[object, str], object]]:
    """What the patch may touch, as it is now (each owner's own attribute); put back after
    the test."""
    before = {(owner, name): _own(owner, name) for owner, name in PATCHED}
    monkeypatch.delattr(cpu.CpuPlatform, "_kvsched_keeps_async", raising=False)
    yield before
    for (owner, name), value in before.items():
        if value is not ABSENT:
            setattr(owner, name, value)
        elif name in owner.__dict__:
            delattr(owner, name)


def test_vllm_cpu_async_patches_nothing_where_vllm_does_not_run_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, restored: dict[tuple[object, str], object]
):
    """On a GPU, vLLM runs async scheduling itself and its CUDA events must stay real."""
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    keep_async_scheduling_on_cpu()
    assert all(_own(owner, name) is restored[owner, name] for owner, name in PATCHED)


def test_vllm_cpu_async_on_the_cpu_stubs_the_output_copys_stream_and_event(
    restored: dict[tuple[object, str], object],
):
    assert current_platform.is_cpu()
    keep_async_scheduling_on_cpu()
    changed = [name for owner, name in PATCHED if _own(owner, name) is not restored[owner, name]]
    assert changed == [name for _, name in PATCHED]
    event = torch.cuda.Event(blocking=True)
    event.record()
    event.synchronize()  # (no CUDA: a no-op)
    with torch.cuda.stream(torch.cuda.Stream()):
        pass


def test_vllm_cpu_async_on_the_cpu_makes_pinning_host_memory_a_no_op(
    restored: dict[tuple[object, str], object],
):
    """(ngram drafts under async scheduling: ``ngram_gpu``'s pinned buffers)"""
    with pytest.raises(RuntimeError, match="pin"):
        torch.zeros(4, pin_memory=True)  # (torch's CPU build: no pinned allocator)
    keep_async_scheduling_on_cpu()
    buf = torch.zeros(4, dtype=torch.long, pin_memory=True)
    assert buf.tolist() == [0, 0, 0, 0] and buf.pin_memory() is buf
