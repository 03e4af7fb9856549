"""Async scheduling on vLLM's CPU build, for tests and benchmarks only.

vLLM's CPU platform turns async scheduling off (``CpuPlatform.check_and_update_config`` sets
``scheduler_config.async_scheduling = False``), so on this machine vLLM's engine core would
never run its asynchronous loop (``step_with_batch_queue``: step N+1 scheduled before step
N's output is processed), which is vLLM's default on GPUs. Two things stand in its way, and
``keep_async_scheduling_on_cpu`` patches both, in this process only:

* the platform's override: the patched ``check_and_update_config`` restores the value the
  user asked for after vLLM's own check ran;
* the GPU runner's asynchronous output copy (``AsyncGPUModelRunnerOutput``), which builds a
  CUDA stream and event: on CPU they become no-ops, as vLLM's CPU runner already does for
  the streams and events it builds at start-up (``cpu_model_runner._torch_cuda_wrapper``).
  The copy itself then runs at once, so the output is ready when the engine core asks.

One more thing stands in the way of speculative decoding with ngram drafts, which vLLM
allows under async scheduling only as ``ngram_gpu`` (plain ``ngram`` is refused there): its
drafter asks for pinned host buffers (``torch.zeros(..., pin_memory=True)`` in the GPU
runner, ``Tensor.pin_memory()`` in ``NgramProposerGPU``), and torch's CPU build has no
pinned allocator. The patch makes pinning a no-op: the buffers are ordinary host memory,
which is where the CPU device reads them anyway.

What runs is vLLM's own asynchronous engine loop, its ``AsyncScheduler`` (or a custom
scheduler class) and its CPU model runner with async scheduling's placeholders; only the
copy's overlap with the next forward is gone. vLLM's engine core must run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``run.py`` sets) for the patch to reach it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any


class _Event:
    """A CUDA event stand-in: every wait is already over on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """A CUDA stream stand-in: work "on" it runs at once, on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _unpinned(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``factory`` (a torch tensor constructor) with its ``pin_memory`` flag dropped."""

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return build


def keep_async_scheduling_on_cpu() -> None:
    """Let vLLM's CPU build run with ``async_scheduling=True`` in this process (idempotent;
    call it before the ``LLM`` is built). On any other platform it does nothing: there
    vLLM runs async scheduling itself, and its CUDA streams and events must stay real."""
    import torch
    from vllm.platforms import cpu, current_platform

    platform = cpu.CpuPlatform
    if not current_platform.is_cpu() or getattr(platform, "_kvsched_keeps_async", False):
        return
    check = platform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    platform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]
    platform._kvsched_keeps_async = True  # type: ignore[attr-defined]
    torch.cuda.Event = _Event  # type: ignore[misc,assignment]
    torch.cuda.Stream = _Stream  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.zeros = _unpinned(torch.zeros)
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
