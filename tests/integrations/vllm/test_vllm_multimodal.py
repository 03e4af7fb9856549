"""Multimodal inputs under kvsched (a tiny Qwen2-Audio on vLLM's CPU build): greedy outputs
equal vLLM's own scheduler's request by request; each audio clip is a kvsched span named by
vLLM's content hash, so a prefix hit never ends inside a clip and a different clip in the
same place never hits; the encoder inputs each step needs are scheduled in vLLM's encoder
cache; the log verifies."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment (its transformers pin conflicts with the "
    "oracle tests'): scripts/test_vllm.sh builds .venv-vllm and runs `pytest -k vllm` there",
)

from kvsched.events.reader import read_log
from kvsched.integrations.vllm.models import build_audio
from kvsched.integrations.vllm.requests import refusal, spans_of

from .test_vllm_scheduler import _script_result, _verifies

AUDIO = """
import json, sys
import numpy as np
from vllm import LLM, SamplingParams
model, scheduler = sys.argv[1], sys.argv[2]
kw = {} if scheduler == "vllm" else {"scheduler_cls": "kvsched.integrations.vllm.Scheduler"}
llm = LLM(model, enforce_eager=True, block_size=32, max_model_len=1024,
          max_num_batched_tokens=256, max_num_seqs=4, dtype="float32", seed=0,
          limit_mm_per_prompt={"audio": 2}, **kw)
rng = np.random.default_rng(0)
clips = [(rng.standard_normal(16000 * (1 + i % 2)).astype(np.float32) * 0.1, 16000)
         for i in range(3)]
head = " ".join(f"t{5 + i}" for i in range(40))
one = head + " <|audio_bos|><|AUDIO|><|audio_eos|> " + " ".join(f"t{60 + i}" for i in range(40))
two = one + " <|audio_bos|><|AUDIO|><|audio_eos|> t9 t10"
greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
rounds = [
    # together: two clips of the same length but different content, one request with two
    [{"prompt": one, "multi_modal_data": {"audio": clips[0]}},
     {"prompt": one, "multi_modal_data": {"audio": clips[2]}},
     {"prompt": two, "multi_modal_data": {"audio": [clips[0], clips[1]]}}],
    # again: prefix hits on the first round's clips (and none on an unseen pair)
    [{"prompt": one, "multi_modal_data": {"audio": clips[0]}},
     {"prompt": two, "multi_modal_data": {"audio": [clips[0], clips[1]]}},
     {"prompt": two, "multi_modal_data": {"audio": [clips[2], clips[1]]}}],
]
out = [o for r in rounds for o in llm.generate(r, greedy, use_tqdm=False)]
print("RESULT" + json.dumps([[list(o.outputs[0].token_ids), o.num_cached_tokens,
                              len(o.prompt_token_ids)] for o in out]))
"""


@pytest.fixture(scope="module")
def audio(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_audio(tmp_path_factory.mktemp("audio") / "model")


def test_vllm_audio_inputs_are_token_identical_to_vllms_own_scheduler(
    audio: Path, tmp_path: Path
):
    """Six requests with one or two audio clips (two rounds): the same tokens as vLLM's own
    scheduler; the repeats hit their first round's blocks, but never past the start of a
    clip the hit would end inside (vLLM's hit may end inside one: docs/vllm.md), and a
    request whose first clip differs hits only the text before it; the log verifies."""
    log = tmp_path / "audio.kvlog"
    ref = _script_result(AUDIO, str(audio), "vllm")
    mine = _script_result(AUDIO, str(audio), "kvsched", env={"KVSCHED_VLLM_LOG": str(log)})
    assert [t for t, _, _ in mine] == [t for t, _, _ in ref]
    assert len({tuple(t) for t, _, _ in mine}) > 2  # (the clips change the tokens)
    # 117- and 172-token prompts, clips at [41, 76) and [118, 169): a repeat hits its
    # blocks past its clips (96); a different clip hits only the text before it (32); the
    # two-clip repeat's hit would end at 160, inside its second clip: kvsched's stops at
    # the block before that clip (96), vLLM's recomputes the clip's encoder output (160).
    assert [c for _, c, _ in ref] == [0, 32, 96, 96, 160, 96]
    assert [c for _, c, _ in mine] == [0, 32, 96, 96, 96, 96]
    _verifies(log)
    arrivals = [e for p in read_log(log).records for e in _arrivals(p)]
    assert [len(a.mm_spans) for a in arrivals] == [1, 1, 2, 1, 2, 2]


def _arrivals(payload: bytes) -> list:
    from kvsched.events import types as ev
    from kvsched.events.codec import decode_record

    return [e for e in decode_record(payload).inputs if isinstance(e, ev.RequestArrived)]


def _request(*items: tuple[int, int, str]) -> NS:
    features = [
        NS(mm_position=NS(offset=o, length=n), identifier=h) for o, n, h in items
    ]
    return NS(
        sampling_params=NS(repetition_detection=None),
        prompt_token_ids=[5] * 100,
        mm_features=features,
        max_tokens=4,
    )


def test_vllm_multimodal_items_become_spans_named_by_their_content_hash():
    request = _request((10, 25, "aa11"), (50, 5, "bb22"))
    spans = spans_of(request)
    assert [(s.start, s.end, s.content_hash) for s in spans] == [
        (10, 35, b"aa11"),
        (50, 55, b"bb22"),
    ]
    assert refusal(request) is None


def test_vllm_multimodal_requests_are_refused_with_the_reason_under_async_scheduling():
    reason = refusal(_request((10, 25, "aa11")), overlapped=True)
    assert reason is not None and "async scheduling" in reason
    assert refusal(_request(), overlapped=True) is None  # (no items: served)
