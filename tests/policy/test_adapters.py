"""LoRA adapters under ``model.max_adapters`` (vLLM's ``max_loras``): a waiting sequence whose
adapter would be one too many is skipped for the step, the others are admitted, and it runs
once an adapter's sequences end."""

from __future__ import annotations

from kvsched.config import ConfigError, ModelSpec

from .helpers import VOCAB, Harness, admitted, request


def _lora(most: int) -> ModelSpec:
    return ModelSpec(vocab_size=VOCAB, max_context=1024, max_adapters=most)


def test_a_second_adapter_waits_while_the_first_runs_and_the_rest_are_admitted_past_it():
    h = Harness(model=_lora(1))
    result = h.step(
        [
            request(0, 12, max_tokens=5, adapter="lora-a"),
            request(1, 12, max_tokens=3, adapter="lora-b"),  # one too many: skipped
            request(2, 12, max_tokens=3),  # no adapter: admitted past it
            request(3, 12, max_tokens=3, adapter="lora-a"),  # the running one's: admitted
        ]
    )
    assert admitted(result) == [0, 2, 3]
    assert h.state.seqs.running_adapters() == {"lora-a"}
    for _ in range(50):
        if 1 in admitted(h.step()):
            break
        assert "lora-a" in h.state.seqs.running_adapters()  # it waits only while lora-a runs
    else:
        raise AssertionError("the lora-b sequence was never admitted")
    assert h.state.seqs.running_adapters() == {"lora-b"}  # admitted once lora-a's ended
    h.run_until_idle()
    assert h.state.stats.requests_finished == 4


def test_without_a_limit_every_adapter_runs_at_once():
    h = Harness()
    result = h.step([request(i, 12, adapter=f"lora-{i}") for i in range(4)])
    assert admitted(result) == [0, 1, 2, 3]


def test_a_negative_adapter_limit_is_refused():
    try:
        Harness(model=_lora(-1))
    except ConfigError as exc:
        assert "max_adapters" in str(exc)
    else:
        raise AssertionError("max_adapters=-1 accepted")
