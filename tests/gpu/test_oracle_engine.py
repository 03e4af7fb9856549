"""End to end: the hybrid scheduler's plans on the torch executor reproduce HF greedy output.

Chat sessions share a system prompt, so later requests hit the prefix cache and resume from
state checkpoints (state_restore / copy_blocks) chosen by the scheduler, not by hand.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import msgspec
import pytest
import torch

from kvsched.config import ModelSpec, SchedulerConfig, Speculation
from kvsched.engine import Engine
from kvsched.events.types import StepExecuted
from kvsched.gpu.torch_executor import TorchExecutor
from kvsched.plan import StepPlan
from kvsched.replay.driver import RunSummary, run
from kvsched.replay.workload import Workload, chat_workload

# three two-turn chat sessions sharing a 40-token system prompt
CHAT = dict(
    sessions=3, turns=2, system_tokens=40, user_tokens=(5, 30), output_tokens=(4, 10),
    vocab_size=512, seed=1,
)


def _run_and_compare(  # type: ignore[no-untyped-def]
    cfg: SchedulerConfig,
    wl: Workload,
    tiny_dir: Path,
    hf_model,
    engine: Engine | None = None,
    step_s: float | None = None,
) -> RunSummary:
    """Serve ``wl`` with the scheduler (``engine``, default a fresh one for ``cfg``) on the
    torch executor; every request's tokens must be HF's greedy continuation of its full
    context. ``step_s``: each step takes this long on the simulated clock (default: its wall
    time), so that arrivals meet the same steps in every run."""
    ex = TorchExecutor(tiny_dir, cfg.num_blocks, cfg.block_size, cfg.num_state_slots, "cpu")
    outputs: dict[int, list[int]] = defaultdict(list)

    class Recording:
        def execute(self, plan: StepPlan) -> StepExecuted:
            res = ex.execute(plan)
            if step_s is not None:
                res = msgspec.structs.replace(res, duration_s=step_s)
            for sid, tok in zip(res.seq_ids.tolist(), res.tokens.tolist(), strict=True):
                outputs[sid].append(tok)
            return res

    engine = engine or Engine(cfg, check_invariants=True)
    summary = run(engine, Recording(), wl)
    assert summary.finished == len(wl.turns)
    context: dict[int, list[int]] = {}
    for turn in wl.turns:
        req = turn.request
        prompt = (context[turn.follows] if turn.follows >= 0 else []) + req.prompt.tolist()
        out = outputs[req.seq_id]
        full = prompt + out
        with torch.no_grad():
            logits = hf_model(
                input_ids=torch.tensor([full]), position_ids=torch.arange(len(full))[None]
            ).logits[0]
        want = logits[len(prompt) - 1 : len(full) - 1].argmax(-1).tolist()
        assert out == want, f"request {req.seq_id}: {out} != HF greedy {want}"
        context[req.seq_id] = full
    return summary


def test_oracle_engine_hybrid_chat_matches_hf_greedy(tiny_dir: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    cfg = SchedulerConfig.from_dict(
        dict(
            model=ModelSpec(vocab_size=512),
            block_size=16,
            num_blocks=400,
            max_batch=8,
            max_prefill_tokens=64,
            hybrid=True,
            checkpoint_budget=32,
        )
    )
    wl = chat_workload(**CHAT)
    summary = _run_and_compare(cfg, wl, tiny_dir, hf_model)
    assert summary.hit_tokens > 0, "the workload should exercise checkpoint restores"


@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "overlapped"])
def test_oracle_engine_preemption_and_recompute_match_hf_greedy(  # type: ignore[no-untyped-def]
    tiny_dir: Path, hf_model, overlapped: bool
) -> None:
    """A cache of 14 blocks for 4 concurrent requests: decode growth preempts (recompute),
    and preempted requests come back through checkpoint restores or a recompute from
    scratch. Overlapped: checkpoints published once their step's outcome lands (two steps
    later), preemption while tokens are out, placeholders decoded with the token sampled
    the step before."""
    cfg = SchedulerConfig.from_dict(
        dict(
            model=ModelSpec(vocab_size=512),
            block_size=16,
            num_blocks=15,
            max_batch=4,
            max_prefill_tokens=32,
            hybrid=True,
            checkpoint_budget=4,  # (kvsched's rules place no "decode": no decode interval)
            speculation={"pipelined": overlapped},
        )
    )
    wl = chat_workload(
        sessions=5,
        turns=1,
        system_tokens=24,
        user_tokens=(10, 40),
        output_tokens=(30, 60),
        vocab_size=512,
        rate_per_s=1000.0,
        seed=2,
    )
    step_s = 0.01 if overlapped else None  # (arrivals meet the same steps in every run)
    summary = _run_and_compare(cfg, wl, tiny_dir, hf_model, step_s=step_s)
    assert summary.preemptions > 0, "the workload should force preemptions"
    assert summary.hit_tokens > 0, "and restore checkpoints"


def test_oracle_engine_overlapped_steps_with_preemption_match_hf_greedy(  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """Overlapped steps (``speculation.pipelined``) on an attention-only model: each plan
    decodes its placeholders with the token the executor sampled in the step before (input id
    -1), sequences preempted while a token is out get it, and every token is HF's."""
    from transformers import Qwen3_5ForCausalLM

    from kvsched.gpu.fixtures import build_tiny_model

    path, _ = build_tiny_model(tmp_path / "attn", seed=3, layer_types=["full_attention"] * 2,
                               num_hidden_layers=2)
    hf = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = SchedulerConfig(
        model=ModelSpec(vocab_size=512),
        block_size=16,
        num_blocks=9,
        max_batch=4,
        max_prefill_tokens=64,
        speculation=Speculation(pipelined=True),
    )
    wl = chat_workload(**CHAT)
    engine = Engine(cfg, check_invariants=True)
    summary = _run_and_compare(cfg, wl, path, hf, engine, step_s=0.01)
    assert engine.state.stats.preemptions > 0  # (tokens out while sequences were preempted)
    assert summary.steps > 0

