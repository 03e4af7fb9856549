"""LoRA under kvsched (vLLM's CPU build, two seeded adapters of the tiny Qwen3): greedy outputs
equal vLLM's own scheduler's request by request, each adapter's prefix is cached apart from
the others', ``max_loras`` is kept in every step, and the log verifies."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment (its transformers pin conflicts with the "
    "oracle tests'): scripts/test_vllm.sh builds .venv-vllm and runs `pytest -k vllm` there",
)

from kvsched.integrations.vllm.models import build, build_lora

from .test_vllm_scheduler import _script_result, _verifies

LORA = """
import json, sys
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.lora.request import LoRARequest
model, scheduler, path_a, path_b = sys.argv[1:5]
kw = {"scheduler_cls": "kvsched.integrations.vllm.Scheduler"} if scheduler == "kvsched" else {}
llm = LLM(model, enforce_eager=True, block_size=32, max_model_len=256, max_num_batched_tokens=256,
          max_num_seqs=4, dtype="float32", skip_tokenizer_init=True, enable_lora=True,
          max_loras=1, max_lora_rank=8, max_cpu_loras=2, async_scheduling=OVERLAP, **kw)
shared = [5 + (i * 7) % 300 for i in range(64)]  # two blocks every prompt starts with
prompts = [TokensPrompt(prompt_token_ids=shared + [11 + i, 40 + i]) for i in range(6)]
loras = [LoRARequest("a", 1, path_a), LoRARequest("b", 2, path_b), None] * 2
params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
base = llm.generate(prompts[:2], params, use_tqdm=False)  # the same prompts, no LoRA
print("RESULT" + json.dumps({"lora": [list(o.outputs[0].token_ids) for o in outs],
                             "cached": [o.num_cached_tokens for o in outs + base],
                             "base": [list(o.outputs[0].token_ids) for o in base]}))
"""


@pytest.mark.parametrize("order", ["sync", "async"])
def test_vllm_lora_requests_are_token_identical_to_vllms_own_scheduler(tmp_path: Path, order):
    """Adapters a and b and none, twice each, with max_loras 1: the runner refuses a step
    that mixes a and b (so kvsched must keep them apart), and the second request of each
    adapter hits only its own adapter's shared prefix; under vLLM's synchronous engine
    loop and its async scheduling (against ``AsyncScheduler``)."""
    overlap = order == "async"
    model = build("qwen3", tmp_path / "model")
    a, b = build_lora(tmp_path / "a", seed=1), build_lora(tmp_path / "b", seed=2)
    log = tmp_path / "lora.kvlog"
    ref = _script_result(LORA, str(model), "vllm", str(a), str(b), overlap=overlap)
    env = {"KVSCHED_VLLM_LOG": str(log)}
    mine = _script_result(LORA, str(model), "kvsched", str(a), str(b), env=env, overlap=overlap)
    assert mine == ref
    assert mine["lora"][:2] != mine["base"]  # the adapters change the tokens
    assert mine["cached"][3:6] == [64, 64, 64]  # each a hit on its own adapter's prefix
    _verifies(log)
