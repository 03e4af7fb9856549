"""Fixtures for the torch executor tests: a tiny seeded Qwen3.5 checkpoint and its HF oracle.

Skipped as a whole when torch, transformers or safetensors is missing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvsched.gpu.fixtures import build_tiny_model  # noqa: E402
from kvsched.gpu.model import HybridModel  # noqa: E402

HFLogits = Callable[[Sequence[int]], "torch.Tensor"]


@pytest.fixture(scope="session", autouse=True)
def _torch_threads() -> None:
    # tiny tensors: one thread is several times faster than two on a loaded 2-core machine
    torch.set_num_threads(1)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3.5"), seed=0)
    return path


@pytest.fixture(scope="session")
def hf_model(tiny_dir: Path) -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = Qwen3_5ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_logits(hf_model: torch.nn.Module) -> HFLogits:
    """All-position logits [L, V] of one sequence: one HF forward, explicit position ids."""

    def run(tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        pos = torch.arange(len(tokens))[None]
        with torch.no_grad():
            out = hf_model(input_ids=ids, position_ids=pos, use_cache=False)
        logits: torch.Tensor = out.logits[0].float()
        return logits

    return run


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path) -> HybridModel:
    return HybridModel.from_pretrained(tiny_dir, device="cpu")
