"""The worked admission of src/kvsched/policy/README.md, run exactly: the README stays true."""

from __future__ import annotations

from tests.policy.helpers import Harness, preset, request, tokens

from kvsched.events import types as ev


def test_the_readme_worked_admission_restores_a_partial_checkpoint_and_saves_the_prompt_end():
    h = Harness(hybrid=True, checkpoint_budget=4, **preset("lmdeploy"))
    prompt = tokens(50, seed=3)
    h.step([request(0, prompt[:40], max_tokens=1)])
    h.run_until_idle()
    d = h.step([request(1, prompt, max_tokens=2)]).decisions[1:]
    assert [type(x).__name__ for x in d] == [
        "SequenceAdmitted", "CheckpointPinned", "PrefixMatched", "BlocksAllocated",
        "CheckpointReserved", "PrefillScheduled",
    ]  # fmt: skip
    admitted, pinned, matched, allocated, reserved, prefill = d
    assert isinstance(matched, ev.PrefixMatched) and isinstance(reserved, ev.CheckpointReserved)
    assert (admitted.seq_id, admitted.row, pinned.ckpt_id) == (1, 0, 1)
    assert matched.blocks.tolist() == [1, 2]
    assert (matched.num_tokens, matched.num_query_tokens) == (40, 50)
    assert (matched.ckpt_id, matched.kv_hit_tokens) == (1, 32)
    assert allocated.blocks.tolist() == [3, 5]
    assert (reserved.ckpt_id, reserved.slot, reserved.num_tokens, reserved.frozen_block) == (
        2,
        10,
        50,
        6,
    )
    assert (prefill.starts.tolist(), prefill.ends.tolist()) == ([40], [50])
