"""``cache_when_planned``: full blocks enter the prefix index in the step whose plan computes
them (vLLM's ``allocate_slots`` -> ``cache_blocks``), so a later request of the same step hits
them; the fingerprint executor checks that what such a hit reads was written."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.config import ConfigError
from kvsched.engine import Engine, create_log
from kvsched.events import types as ev
from kvsched.gpu.fingerprint import FingerprintExecutor
from kvsched.replay.verify import verify_log

from .helpers import VOCAB, Harness, config, matched, of_type, request, tokens


def _harness(planned: bool, **overrides: object) -> Harness:
    kw: dict[str, object] = {"max_prefill_tokens": 256, "dedup_cached_blocks": False}
    kw.update(overrides)
    cfg = config(cache_when_planned=planned, **kw)
    h = Harness(cfg)
    h.executor = FingerprintExecutor(VOCAB, cfg.num_blocks, cfg.block_size, cfg.num_state_slots)
    return h


def _burst(n: int) -> list[ev.RequestArrived]:
    """``n`` prompts submitted together: a 100-token shared prefix, then their own tokens."""
    shared = tokens(100, seed=7)
    return [
        request(i + 1, np.concatenate([shared, tokens(20, seed=100 + i)]), max_tokens=6)
        for i in range(n)
    ]


def _serve(h: Harness, inputs: list[ev.RequestArrived]) -> dict[int, list[int]]:
    """Run the requests to the end; their sampled tokens by sequence id."""
    out: dict[int, list[int]] = {}
    h.step(inputs)
    for result in [h.results[-1], *h.run_until_idle()]:
        for e in result.inputs:
            if isinstance(e, ev.StepExecuted):
                for sid, tok in zip(e.seq_ids.tolist(), e.tokens.tolist(), strict=True):
                    out.setdefault(sid, []).append(tok)
    return out


def _hits(h: Harness) -> dict[int, int]:
    return {sid: m.num_tokens for r in h.results for sid, m in matched(r).items()}


def test_a_later_request_of_the_same_step_hits_the_blocks_an_earlier_one_computes():
    planned, after = _harness(True), _harness(False)
    tokens_planned = _serve(planned, _burst(4))
    tokens_after = _serve(after, _burst(4))
    first = planned.results[0]
    assert {sid: m.num_tokens for sid, m in matched(first).items()} == {1: 0, 2: 96, 3: 96, 4: 96}
    assert _hits(after).get(2, 0) == 0  # cached only after the outcome: no same-step hit
    assert tokens_planned == tokens_after  # a hit reads exactly what a cold run computes
    assert not planned.executor.mismatches, planned.executor.mismatches[:3]


def test_blocks_are_cached_in_the_step_that_schedules_them_and_the_log_verifies(tmp_path):
    h = _harness(True)
    log = create_log(str(tmp_path / "planned.log"), h.config)
    h.engine = Engine(h.config, log=log, check_invariants=True)
    try:
        _serve(h, _burst(2))
    finally:
        log.close()
    first = h.results[0].decisions
    kinds = [type(d) for d in first if isinstance(d, ev.PrefillScheduled | ev.BlocksCached)]
    assert kinds == [ev.PrefillScheduled, ev.BlocksCached, ev.PrefillScheduled, ev.BlocksCached]
    result = verify_log(str(tmp_path / "planned.log"))
    assert result.ok and result.steps == len(h.results)


def test_a_failed_step_evicts_the_blocks_it_cached_at_planning_and_preempts_its_sequences():
    h = _harness(True)
    h.step(_burst(3))
    assert h.state.pool.num_cached >= 6
    h.outcome = [ev.StepFailed(step=h.results[-1].plan.step, reason="boom")]
    result = h.step()
    evicted = [b for d in of_type(result.decisions, ev.BlocksEvicted) for b in d.blocks.tolist()]
    preempted = of_type(result.decisions, ev.SequencePreempted)
    assert len(preempted) == 3 and len(evicted) >= 6
    out = [result, *h.run_until_idle()]
    assert not h.executor.mismatches, h.executor.mismatches[:3]
    assert out


def test_caching_at_planning_refuses_settings_that_would_read_unwritten_blocks():
    with pytest.raises(ConfigError, match="cache_when_planned"):
        config(cache_when_planned=True, dedup_cached_blocks=True)


def test_caching_at_planning_serves_kvscheds_own_external_saves():
    """kvsched's saves start at the fold of the outcome that wrote their blocks, so caching
    at planning may run beside them (ExternalKVMachineUnderVllmStore checks what they read)."""
    cfg = config(cache_when_planned=True, dedup_cached_blocks=False, external_kv=True)
    assert cfg.cache_when_planned and cfg.external_save
