"""Cached-token counts: each finished or aborted sequence reports the prompt tokens its first
admission took without computing them (vLLM's ``num_cached_tokens``), split into local prefix
hits, checkpoint restores (hybrid models) and external loads."""

from __future__ import annotations

import numpy as np
import pytest
from tests.replay import external_helpers
from tests.replay.external_helpers import Node, prompt

from kvsched.connectors import InProcessStore
from kvsched.events import types as ev

from .helpers import Harness, of_type, request, tokens
from .test_hybrid import hybrid

PREFIX = tokens(32, seed=5)  # two 16-token blocks


def finished(h: Harness | Node) -> dict[int, tuple[int, int, int]]:
    """(local, checkpoint, external) cached tokens of every finished sequence."""
    decisions = h.decisions if isinstance(h, Node) else [d for r in h.results for d in r.decisions]
    out: dict[int, tuple[int, int, int]] = {}
    for d in of_type(decisions, ev.SequenceFinished):
        counts = zip(
            d.cached_local.tolist(),
            d.cached_checkpoint.tolist(),
            d.cached_external.tolist(),
            strict=True,
        )
        out.update(zip(d.seq_ids.tolist(), counts, strict=True))
    return out


def test_a_finished_sequence_reports_its_local_prefix_hit_as_cached_tokens() -> None:
    h = Harness()
    h.step([request(0, np.concatenate([PREFIX, tokens(8, seed=6)]), max_tokens=3)])
    h.run_until_idle()
    h.step([request(1, np.concatenate([PREFIX, tokens(10, seed=7)]), max_tokens=3)])
    h.run_until_idle()
    assert finished(h) == {0: (0, 0, 0), 1: (32, 0, 0)}


def test_a_hybrid_sequence_reports_the_tokens_its_restored_checkpoint_covers() -> None:
    h = hybrid()
    first = tokens(40, seed=8)
    h.step([request(0, first, max_tokens=2)])  # publishes a checkpoint at its prompt end, 40
    h.run_until_idle()
    h.step([request(1, np.concatenate([first, tokens(10, seed=9)]), max_tokens=2)])
    h.run_until_idle()
    assert finished(h)[1] == (0, 40, 0)


def test_an_aborted_sequence_reports_its_cached_tokens() -> None:
    h = Harness()
    h.step([request(0, np.concatenate([PREFIX, tokens(8, seed=6)]), max_tokens=2)])
    h.run_until_idle()
    h.step([request(1, np.concatenate([PREFIX, tokens(10, seed=7)]), max_tokens=50)])
    h.step()
    result = h.step([ev.RequestAborted(1)])
    (aborted,) = of_type(result.decisions, ev.SequenceAborted)
    assert (aborted.cached_local, aborted.cached_checkpoint, aborted.cached_external) == (32, 0, 0)


def test_a_preempted_sequence_keeps_the_counts_of_its_first_admission() -> None:
    h = Harness()
    h.step([request(0, np.concatenate([PREFIX, tokens(8, seed=6)]), max_tokens=2)])
    h.run_until_idle()
    h.step([request(1, np.concatenate([PREFIX, tokens(10, seed=7)]), max_tokens=8)])
    h.step([ev.DrainRequested()])  # preempted; the cache is cleared: it recomputes everything
    h.step([ev.WakeRequested()])
    h.run_until_idle()
    assert h.state.stats.preemptions == 1
    assert finished(h)[1] == (32, 0, 0)  # as vLLM: the first scheduling's hit


@pytest.mark.parametrize("hybrid_model", [False, True], ids=["attention", "hybrid"])
def test_tokens_loaded_from_the_external_store_are_reported_as_external(
    hybrid_model: bool,
) -> None:
    p = prompt(300)
    store = InProcessStore()
    a = Node(store, external_helpers.config(hybrid=hybrid_model, external_kv=True))
    a.run([ev.RequestArrived(1, p, 4)])
    b = Node(store, external_helpers.config(hybrid=hybrid_model, external_kv=True))
    b.run([ev.RequestArrived(3, p[:100], 2)])  # its first 6 blocks cached locally
    b.run([ev.RequestArrived(7, p, 4)])
    (load,) = [d for d in b.of_type(ev.KVLoadStarted) if d.seq_id == 7]
    local, loaded = load.first_block * 16, len(load.blocks) * 16
    assert local and loaded and local + loaded == 288  # (the last token is computed)
    assert finished(b)[7] == (local, 0, loaded)


def test_with_report_cached_tokens_off_the_events_carry_no_counts() -> None:
    h = Harness(report_cached_tokens=False)
    h.step([request(0, np.concatenate([PREFIX, tokens(8, seed=6)]), max_tokens=2)])
    h.run_until_idle()
    h.step([request(1, np.concatenate([PREFIX, tokens(10, seed=7)]), max_tokens=3)])
    h.run_until_idle()
    for d in of_type([d for r in h.results for d in r.decisions], ev.SequenceFinished):
        assert not len(d.cached_local) and not len(d.cached_external)
