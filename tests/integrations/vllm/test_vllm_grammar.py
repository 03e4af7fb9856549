"""Structured outputs under the adapter (``integrations/vllm/grammar.py``): a request waits
for its grammar outside kvsched, its sampling rows get the grammar's bitmask, a failed or
rejecting grammar ends the request with an error (no model: vLLM's structured-output
manager is replaced by a fake whose grammars the test completes)."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment (its transformers pin conflicts with the "
    "oracle tests'): scripts/test_vllm.sh builds .venv-vllm and runs `pytest -k vllm` there",
)

from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request, RequestStatus

from kvsched.integrations.vllm import harness as h
from kvsched.integrations.vllm.models import VOCAB, build, words

from .test_vllm_scheduler import _script_result, _verifies

BLOCK = 64


class FakeManager:
    """What the adapter asks of vLLM's StructuredOutputManager; records the calls."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.bitmasks: list[list[str]] = []
        self.accepted: list[tuple[str, list[int]]] = []

    def grammar_bitmask(self, requests: Any, names: list[str], spec: Any) -> np.ndarray:
        assert all(name in requests for name in names)
        self.bitmasks.append(list(names))
        return np.full((len(names), -(-VOCAB // 32)), -1, dtype=np.int32)

    def accept_tokens(self, request: Any, tokens: list[int]) -> bool:
        self.accepted.append((request.request_id, list(tokens)))
        return self.accept


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build("qwen3", tmp_path_factory.mktemp("qwen3") / "model"))


def adapter(model: str, manager: FakeManager) -> Any:
    from kvsched.integrations.vllm.scheduler import Scheduler

    vllm_config, kv = h.configs(model, blocks=50, max_seqs=4, batched=256, block_size=BLOCK)
    sched = Scheduler(vllm_config, kv, manager, BLOCK, BLOCK)
    sched.test_driver = h.Driver(sched, VOCAB)  # (the synthetic model runner of its steps)
    return sched


def structured(name: str, grammar: Future[Any], max_tokens: int = 3) -> Request:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(regex="t1+"),
    )
    request = Request(name, list(range(3, 40)), params, None)
    assert request.structured_output_request is not None
    request.structured_output_request.grammar = grammar
    return request


def step(sched: Any) -> tuple[SchedulerOutput, Any, dict[Any, Any]]:
    """One synchronous engine step with the synthetic model; (output, grammar, results)."""
    so = sched.schedule()
    grammar = sched.get_grammar_bitmask(so)
    mro = sched.test_driver.run_model(so)
    return so, grammar, sched.update_from_output(so, mro)


def outputs(results: dict[Any, Any]) -> list[Any]:
    return [out for outs in results.values() for out in outs.outputs]


def test_vllm_a_structured_request_reaches_kvsched_once_its_grammar_is_compiled(model: str):
    manager = FakeManager()
    sched = adapter(model, manager)
    compiling: Future[Any] = Future()
    request = structured("a", compiling)
    sched.add_request(request)
    so, grammar, _ = step(sched)
    assert so.total_num_scheduled_tokens == 0 and grammar is None
    assert request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert sched.engine.state.seqs.waiting == {}  # kvsched has not seen it
    assert sched.get_num_unfinished_requests() == 1
    assert sched.get_request_counts() == (0, 1)  # (waiting, as vLLM counts it)
    compiling.set_result(object())
    so, grammar, results = step(sched)
    assert so.num_scheduled_tokens == {"a": 37}
    assert grammar is not None and grammar.structured_output_request_ids == ["a"]
    assert grammar.grammar_bitmask.shape[0] == 1
    (out,) = outputs(results)
    assert manager.accepted == [("a", out.new_token_ids)]  # the grammar advanced by it
    for _ in range(3):
        step(sched)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert [names for names in manager.bitmasks] == [["a"], ["a"], ["a"]]
    sched.shutdown()


def test_vllm_a_grammar_that_fails_to_compile_ends_its_request_with_the_error(model: str):
    sched = adapter(model, FakeManager())
    failed: Future[Any] = Future()
    failed.set_exception(ValueError("no such grammar"))
    sched.add_request(structured("a", failed))
    _, _, results = step(sched)
    (out,) = outputs(results)
    assert out.finish_reason == FinishReason.ERROR
    assert "grammar failed: no such grammar" in str(out.stop_reason)
    assert sched.get_num_unfinished_requests() == 0
    assert not sched.has_requests()
    sched.shutdown()


def test_vllm_a_request_aborted_while_its_grammar_compiles_never_reaches_kvsched(model: str):
    sched = adapter(model, FakeManager())
    compiling: Future[Any] = Future()
    sched.add_request(structured("a", compiling))
    (done,) = sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert done.status == RequestStatus.FINISHED_ABORTED
    compiling.set_result(object())
    so, _, _ = step(sched)
    assert so.total_num_scheduled_tokens == 0
    assert not sched.has_requests() and sched.engine.state.seqs.seqs == {}
    sched.shutdown()


def test_vllm_a_token_the_grammar_rejects_ends_the_request_with_an_error(model: str):
    sched = adapter(model, FakeManager(accept=False))
    ready: Future[Any] = Future()
    ready.set_result(object())
    request = structured("a", ready, max_tokens=5)
    sched.add_request(request)
    _, _, results = step(sched)
    (out,) = outputs(results)
    assert out.finish_reason == FinishReason.ERROR
    assert request.status == RequestStatus.FINISHED_ERROR
    step(sched)  # kvsched retires it (an abort: a rule kvsched does not have)
    assert sched.engine.state.seqs.seqs == {} and not sched.has_requests()
    sched.shutdown()


STRUCTURED = """
import json, sys
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.sampling_params import StructuredOutputsParams
kw = {"scheduler_cls": "kvsched.integrations.vllm.Scheduler"} if sys.argv[2] == "kvsched" else {}
kw["async_scheduling"] = OVERLAP
if len(sys.argv) > 3:  # ngram speculative decoding with this many drafts, synchronous only:
    # under async scheduling (ngram_gpu) vLLM's own AsyncScheduler on its CPU build ends
    # choice requests with a grammar error, so it is no reference (docs/vllm.md)
    kw |= {"async_scheduling": False,
           "speculative_config": {"method": "ngram", "num_speculative_tokens": int(sys.argv[3]),
                                  "prompt_lookup_max": 4, "prompt_lookup_min": 1}}
llm = LLM(sys.argv[1], enforce_eager=True, block_size=32, max_model_len=512,
          max_num_batched_tokens=256, max_num_seqs=8, dtype="float32", **kw)
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
schedule, verified = scheduler.schedule, {}  # per request: the drafts each decode verifies
def counting(*args, **kwargs):
    out = schedule(*args, **kwargs)
    for name, drafts in out.scheduled_spec_decode_tokens.items():
        verified.setdefault(name.split("-")[0], []).append(len(drafts))  # (its index)
    return out
scheduler.schedule = counting
prompts = [TokensPrompt(prompt_token_ids=[5 + (i * k) % 400 for i in range(40 + 7 * k)])
           for k in (13, 17, 19, 23)]
schema = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
          "properties": {"a": {"type": "integer"},
                         "b": {"type": "array", "maxItems": 3,
                               "items": {"type": "string", "maxLength": 3}}}}
kinds = {"json": StructuredOutputsParams(json=schema),
         "regex": StructuredOutputsParams(regex="(t1[0-9]|t2[0-9]){3,6}"),
         "choice": StructuredOutputsParams(choice=["t7t8", "t9", "t10t11t12"])}
got = {}
for label, so in kinds.items():
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got[label] = [[list(o.outputs[0].token_ids), o.outputs[0].finish_reason] for o in outs]
got["verified"] = verified
print("RESULT" + json.dumps(got))
"""


def _texts(tokens: list[int]) -> str:
    """The characters a grammar saw: each token's text, concatenated (eos left out)."""
    texts = words(json_chars=True)
    return "".join(texts[t] for t in tokens if t != 1)


@pytest.mark.parametrize("order", ["sync", "async"])
def test_vllm_structured_outputs_are_token_identical_to_vllms_own_scheduler(
    tmp_path_factory: pytest.TempPathFactory, order: str
):
    """JSON schema, regex and choice, four prompts each (tiny Qwen3 whose tokenizer can write
    JSON): the same tokens and finish reasons; the kvsched run's log verifies. Under vLLM's
    synchronous engine loop and under its async scheduling (against ``AsyncScheduler``: a
    bitmask waits for the tokens still out)."""
    model = build("qwen3", tmp_path_factory.mktemp("qwen3-json") / "model", json_chars=True)
    log, overlap = tmp_path_factory.mktemp("log") / "structured.kvlog", order == "async"
    ref = _script_result(STRUCTURED, str(model), "vllm", overlap=overlap)
    env = {"KVSCHED_VLLM_LOG": str(log)}
    mine = _script_result(STRUCTURED, str(model), "kvsched", env=env, overlap=overlap)
    assert mine == ref
    for tokens, reason in ref["json"]:
        if reason == "stop":
            value = json.loads(_texts(tokens))
            assert isinstance(value["a"], int) and isinstance(value["b"], list)
    assert any(reason == "stop" for _, reason in ref["json"])
    for tokens, reason in ref["regex"]:
        assert reason == "stop" and re.fullmatch("(t1[0-9]|t2[0-9]){3,6}", _texts(tokens))
    assert {_texts(tokens) for tokens, _ in ref["choice"]} <= {"t7t8", "t9", "t10t11t12"}
    _verifies(log)
