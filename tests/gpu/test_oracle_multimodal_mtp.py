"""Issue 16 items 3 and 4 on the torch executor, against transformers greedy output.

Multimodal: a prompt whose spans cross the canonical chunk boundaries, then a request sharing
a prefix whose cached chain ends inside a span; no forward starts or ends inside a span and
every token is HF's. MTP: a hit recomputes exactly one block (two speculative tokens) into a
private block; the shared cached block's KV is never written, the private copy holds the
same KV, and every token is HF's. Each runs on an attention-only and on a hybrid model.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.mtp_images import SpansWhole

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine, StepResult
from kvsched.events import types as ev
from kvsched.gpu.fixtures import build_tiny_model
from kvsched.gpu.torch_executor import TorchExecutor

VOCAB = 512
BS = 16


@pytest.fixture(scope="module")
def attention_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = build_tiny_model(
        tmp_path_factory.mktemp("tiny-attention"), seed=5, layer_types=["full_attention"] * 4
    )
    return path


@pytest.fixture(scope="module")
def attention_hf(attention_dir: Path) -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(attention_dir, dtype=torch.float32).eval()


@pytest.fixture(params=["attention", "hybrid"])
def model(request: pytest.FixtureRequest) -> tuple[bool, Path, torch.nn.Module]:
    """(hybrid, checkpoint directory, its HF oracle)."""
    if request.param == "hybrid":
        return True, request.getfixturevalue("tiny_dir"), request.getfixturevalue("hf_model")
    return False, request.getfixturevalue("attention_dir"), request.getfixturevalue("attention_hf")


class Served:
    """One engine on one torch executor whose plans must never split a multimodal span."""

    def __init__(self, cfg: SchedulerConfig, model_dir: Path) -> None:
        self.engine = Engine(cfg, check_invariants=True)
        self.torch = TorchExecutor(model_dir, cfg.num_blocks, BS, cfg.num_state_slots, "cpu")
        self.executor = SpansWhole(self.torch, self.engine.state)
        self.outputs: dict[int, list[int]] = defaultdict(list)
        self.outcome: list[ev.Event] = []
        self.clock = 0.0
        self.written: set[int] = set()  # KV blocks the executed plans wrote

    def step(self, inputs: list[ev.Event] | None = None) -> StepResult:
        result = self.engine.step([*self.outcome, *(inputs or [])], self.clock)
        self.outcome = []
        self.clock += 0.01
        if not result.plan.is_empty:
            plan = result.plan
            self.written.update((plan.slot_mapping // BS).tolist())
            for copies in (plan.copy_blocks, plan.copy_blocks_after):
                self.written.update(np.asarray(copies).reshape(-1, 2)[:, 1].tolist())
            executed = self.executor.execute(plan)
            for sid, tok in zip(executed.seq_ids.tolist(), executed.tokens.tolist(), strict=True):
                self.outputs[sid].append(tok)
            self.outcome = [executed]
        return result

    def run_until_idle(self) -> None:
        for _ in range(500):
            if not self.engine.has_work and not self.outcome:
                return
            self.step()
        raise AssertionError("the engine did not become idle")

    def kv(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of one block in every attention layer (a copy)."""
        cache = self.torch.cache
        return cache.key_all[:, block].clone(), cache.value_all[:, block].clone()


def _hf_greedy(hf_model: torch.nn.Module, prompt: np.ndarray, out: list[int]) -> list[int]:
    full = prompt.tolist() + out
    with torch.no_grad():
        logits = hf_model(
            input_ids=torch.tensor([full]), position_ids=torch.arange(len(full))[None]
        ).logits[0]
    want: list[int] = logits[len(prompt) - 1 : len(full) - 1].argmax(-1).tolist()
    return want


def _config(hybrid: bool, **overrides: object) -> SchedulerConfig:
    base: dict[str, object] = {
        "model": ModelSpec(vocab_size=VOCAB),
        "block_size": BS,
        "num_blocks": 64,
        "max_batch": 4,
        "max_prefill_tokens": 32,
        "hybrid": hybrid,
        **({"checkpoint_budget": 16} if hybrid else {}),
    }
    base.update(overrides)
    return SchedulerConfig.from_dict(base)


def _prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, VOCAB, n, dtype=np.int32)


def test_spans_across_chunk_boundaries_and_a_hit_inside_a_span_match_hf_greedy(model) -> None:  # type: ignore[no-untyped-def]
    hybrid, model_dir, hf_model = model
    served = Served(_config(hybrid), model_dir)
    # Spans across the canonical boundaries 32 and 64 (32-token chunks).
    spans = (ev.MultimodalSpan(20, 40, b"image-a"), ev.MultimodalSpan(50, 88, b"image-b"))
    first = _prompt(90, seed=1)  # its cached chain: 5 full blocks, to 80 (inside a span)
    served.step([ev.RequestArrived(0, first, 4, mm_spans=spans)])
    served.run_until_idle()
    second = np.concatenate([first, _prompt(20, seed=2)])
    admit = served.step([ev.RequestArrived(1, second, 6, mm_spans=spans)])
    hit = next(d for d in admit.decisions if isinstance(d, ev.PrefixMatched))
    assert not any(s.start < hit.num_tokens < s.end for s in spans)
    if not hybrid:
        assert hit.num_tokens == 48  # rewound from 80 out of [50, 88), down to a block
    served.run_until_idle()
    for seq_id, prompt in ((0, first), (1, second)):
        out = served.outputs[seq_id]
        assert out == _hf_greedy(hf_model, prompt, out), f"request {seq_id}"


def test_an_mtp_hit_recomputes_one_block_privately_and_matches_hf_greedy(model) -> None:  # type: ignore[no-untyped-def]
    hybrid, model_dir, hf_model = model
    # 16-token chunks: a hybrid producer saves a state at every block boundary.
    served = Served(_config(hybrid, max_prefill_tokens=16, num_speculative_tokens=2), model_dir)
    first = _prompt(64, seed=3)
    served.step([ev.RequestArrived(0, first, 4)])
    served.run_until_idle()
    second = np.concatenate([first, _prompt(10, seed=4)])
    admit = served.step([ev.RequestArrived(1, second, 6)])
    hit = next(d for d in admit.decisions if isinstance(d, ev.PrefixMatched))
    assert hit.num_tokens == 48 and hit.overlap_block  # 4 cached blocks: one recomputed
    shared = hit.overlap_block
    private = int(served.engine.state.seqs.table[served.engine.state.seq(1).row, 3])
    assert private != shared
    before = served.kv(shared)
    served.written = set(np.asarray(admit.plan.slot_mapping // BS).tolist())
    served.run_until_idle()
    assert private in served.written and shared not in served.written  # never written
    after = served.kv(shared)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    for recomputed, cached in zip(served.kv(private), after, strict=True):
        torch.testing.assert_close(recomputed, cached, atol=1e-5, rtol=1e-5)
    for seq_id, prompt in ((0, first), (1, second)):
        out = served.outputs[seq_id]
        assert out == _hf_greedy(hf_model, prompt, out), f"request {seq_id}"
