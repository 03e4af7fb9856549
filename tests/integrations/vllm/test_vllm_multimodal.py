"""Multimodal inputs under kvsched (a tiny Qwen2-Audio on vLLM's CPU build): greedy outputs
and cached tokens equal vLLM's own scheduler's request by request; each audio clip is a
kvsched span named by vLLM's content hash, so a different clip in the same place never hits;
the encoder inputs each step needs are scheduled in vLLM's encoder cache (kept across a
request's chunks where a hit or chunk ends inside a clip); the log verifies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment (its transformers pin conflicts with the "
    "oracle tests'): scripts/test_vllm.sh builds .venv-vllm and runs `pytest -k vllm` there",
)

from kvsched.events import types as ev
from kvsched.events.codec import decode_record
from kvsched.events.reader import read_log
from kvsched.integrations.vllm import harness as h
from kvsched.integrations.vllm.models import build_audio

from .test_vllm_harness import assert_same_outputs
from .test_vllm_scheduler import _script_result, _verifies

AUDIO = """
import json, sys
import numpy as np
from vllm import LLM, SamplingParams
model, scheduler = sys.argv[1], sys.argv[2]
kw = {} if scheduler == "vllm" else {"scheduler_cls": "kvsched.integrations.vllm.Scheduler"}
llm = LLM(model, enforce_eager=True, block_size=32, max_model_len=1024,
          max_num_batched_tokens=68, max_num_seqs=4, dtype="float32", seed=0,
          limit_mm_per_prompt={"audio": 2}, async_scheduling=OVERLAP, **kw)
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


@pytest.mark.parametrize("order", ["sync", "async"])
def test_vllm_audio_inputs_are_token_identical_to_vllms_own_scheduler(
    audio: Path, tmp_path: Path, order: str
):
    """Six requests with one or two audio clips (two rounds): the same tokens and the same
    cached tokens as vLLM's own scheduler, request by request (a repeat hits its first
    round's blocks, even where its hit ends inside a clip; a request whose first clip
    differs hits only the text before it); the log verifies. Under vLLM's synchronous
    engine loop and its async scheduling (against ``AsyncScheduler``)."""
    log, overlap = tmp_path / "audio.kvlog", order == "async"
    ref = _script_result(AUDIO, str(audio), "vllm", overlap=overlap)
    env = {"KVSCHED_VLLM_LOG": str(log)}
    mine = _script_result(AUDIO, str(audio), "kvsched", env=env, overlap=overlap)
    assert [t for t, _, _ in mine] == [t for t, _, _ in ref]
    assert len({tuple(t) for t, _, _ in mine}) > 2  # (the clips change the tokens)
    # 117- and 172-token prompts, clips at [41, 76) and [118, 169): a repeat hits its
    # blocks past its clips (96); a different clip hits only the text before it (32); the
    # two-clip repeat hits 160, inside its second clip, whose embeddings past the hit the
    # runner takes from that clip's encoder output (kvsched, as vLLM, lets a hit end
    # inside an item: span_slices).
    assert [c for _, c, _ in ref] == [0, 32, 96, 96, 160, 96]
    assert [c for _, c, _ in mine] == [c for _, c, _ in ref]
    _verifies(log)
    records = [decode_record(p) for p in read_log(log).records]
    arrivals = [e for r in records for e in r.inputs if isinstance(e, ev.RequestArrived)]
    assert [len(a.mm_spans) for a in arrivals] == [1, 1, 2, 1, 2, 2]
    spans = {a.seq_id: a.mm_spans for a in arrivals}
    chunks = [
        (q, end)
        for r in records
        for d in r.decisions
        if isinstance(d, ev.PrefillScheduled)
        for q, end in zip(d.seq_ids.tolist(), d.ends.tolist(), strict=True)
    ]
    # (64-token chunks: some end inside a clip, whose encoder output the next one reuses)
    assert any(s.start < end < s.end for q, end in chunks for s in spans[q])


def _mm_workload(seed: int) -> list[h.Op]:
    """Requests with 400-position audio items (offset, length, content hash), which 64-token
    chunks split and two of which overflow vLLM's encoder cache (750 positions): one
    repeating another's prompt, one whose hit ends inside an item evicted from that cache
    since (so its encoder output is computed again), one with two items a 512-token chunk
    reaches together, an abort, arrivals between steps."""
    rng = np.random.default_rng(seed)

    def fresh(n: int) -> tuple[int, ...]:
        return tuple(rng.integers(3, 400, n).tolist())

    a = fresh(500)
    return [
        h.Add("a", a, 12, items=((20, 400, "clip-a"),)),
        h.Add("b", fresh(460), 10, items=((10, 400, "clip-b"),)),
        h.Steps(3),
        h.Add("c", a, 8, items=((20, 400, "clip-a"),)),
        h.Add("d", fresh(500), 10, items=((60, 400, "clip-c"),)),
        h.Add("e", fresh(90), 30, items=((0, 50, "clip-d"),)),
        h.Steps(4),
        h.Abort("e"),
        h.Steps(60),
        h.Add("f", a[:400] + fresh(40), 6, items=((20, 400, "clip-a"),)),
        h.Steps(30),
        # two items one chunk may reach together (600 of the cache's 750 positions)
        h.Add("g", fresh(640), 4, items=((10, 300, "clip-e"), (320, 300, "clip-f"))),
        h.Steps(30),
    ]


@pytest.mark.parametrize("blocks", [100, 32], ids=["roomy", "tight"])
@pytest.mark.parametrize("batched", [68, 516], ids=["chunks-64", "chunks-512"])
@pytest.mark.parametrize("order", ["sync", "async"])
def test_vllm_adapter_schedules_audio_items_as_vllms_scheduler_in_both_orders(
    audio: Path, tmp_path: Path, order: str, batched: int, blocks: int
):
    """Audio items split by 64-token chunks (or in 512-token ones), shared, repeated and
    evicted from the encoder cache, 32 blocks or 100, an abort, in vLLM's synchronous and
    asynchronous call orders: the runner finds the encoder output of every item each chunk
    reaches (``RunnerEncoder``: scheduled then or kept since), the encoder cache never holds
    more than its size (under async scheduling a step in flight holds its items: the next
    waits), the encoder runs as often as under vLLM's scheduler, the outputs and cached
    tokens are vLLM's (``Scheduler`` or ``AsyncScheduler``), and the log verifies."""
    log = tmp_path / "mm.kvlog"
    ref_kind = "vllm" if order == "sync" else "vllm-async"
    script = _mm_workload(0)
    traces = {}
    for kind in (ref_kind, "kvsched"):
        config, kv = h.configs(str(audio), blocks, max_seqs=4, batched=batched, block_size=32)
        if kind == "kvsched":
            config.additional_config = {"kvsched": {"log": str(log), "check_invariants": True}}
        config.scheduler_config.async_scheduling = order == "async"
        sched = h.make(kind, config, kv)
        vocab = config.model_config.get_vocab_size()
        try:
            traces[kind] = h.drive(sched, script, order, vocab, 32)
        finally:
            sched.shutdown()
    ref, mine = traces[ref_kind], traces["kvsched"]
    assert_same_outputs(ref, mine, script, vocab)
    assert mine.encoded == ref.encoded == 6  # (clip-a twice: evicted before f needs it)
    assert mine.cached == ref.cached and mine.cached["f"] == 384  # (a hit inside clip-a)
    _verifies(log)
