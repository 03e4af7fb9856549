"""Executors: apply StepPlans and report outcomes.

``SimulatedExecutor`` (cost model, no tensors) imports eagerly. The torch executor and the
hybrid model import torch, so they load lazily on first access: ``from kvsched.gpu import
TorchExecutor`` works when torch is installed, and ``import kvsched.gpu`` works without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvsched.gpu.sim import CostModel, SimulatedExecutor

if TYPE_CHECKING:
    from kvsched.gpu.cache import PagedCache
    from kvsched.gpu.config import HybridConfig
    from kvsched.gpu.model import HybridModel
    from kvsched.gpu.torch_executor import TorchExecutor

_LAZY = {
    "TorchExecutor": "kvsched.gpu.torch_executor",
    "HybridModel": "kvsched.gpu.model",
    "HybridConfig": "kvsched.gpu.config",
    "PagedCache": "kvsched.gpu.cache",
}

__all__ = [
    "CostModel",
    "HybridConfig",
    "HybridModel",
    "PagedCache",
    "SimulatedExecutor",
    "TorchExecutor",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsched.gpu' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
