"""Multimodal spans are never split: chunk boundaries (canonical: the same whatever the hit),
attention prefix hits, loads from the store and saved states stay outside every span; a span
longer than the chunk budget is a chunk of its own. Logs before schema 4 did not keep this."""

import numpy as np
import pytest
from tests.policy.helpers import (
    VOCAB,
    Harness,
    matched,
    of_type,
    prefills,
    preset,
    request,
    tokens,
)

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.events import types as ev
from kvsched.policy import spans as spans_module


def _span(start: int, end: int, content: bytes = b"image") -> ev.MultimodalSpan:
    return ev.MultimodalSpan(start, end, content)


def _chunks(h: Harness, seq_id: int) -> list[tuple[int, int]]:
    """Every prefill chunk ``seq_id`` was scheduled so far, in order."""
    return [(s, e) for r in h.results for q, s, e in prefills(r) if q == seq_id]


def _splits(chunks: list[tuple[int, int]], spans: tuple[ev.MultimodalSpan, ...]) -> list[int]:
    """Chunk boundaries strictly inside a span."""
    return [p for c in chunks for p in c if any(s.start < p < s.end for s in spans)]


def test_a_chunk_boundary_inside_a_multimodal_span_moves_to_the_span_start() -> None:
    h = Harness()  # 64-token chunks
    spans = (_span(50, 100),)
    h.step([request(0, tokens(150, seed=1), max_tokens=1, mm_spans=spans)])
    h.run_until_idle()
    assert _chunks(h, 0) == [(0, 50), (50, 100), (100, 128), (128, 150)]


def test_a_span_longer_than_the_chunk_budget_is_one_chunk_of_its_own() -> None:
    h = Harness()
    spans = (_span(70, 200),)
    h.step([request(0, tokens(230, seed=2), max_tokens=1, mm_spans=spans)])
    h.run_until_idle()
    assert _chunks(h, 0) == [(0, 64), (64, 70), (70, 200), (200, 230)]


def test_chunk_boundaries_never_split_a_span_and_do_not_depend_on_the_hit() -> None:
    spans = (_span(40, 70), _span(120, 140))
    prompt = tokens(180, seed=3)
    cold = Harness()
    cold.step([request(1, prompt, max_tokens=1, mm_spans=spans)])
    cold.run_until_idle()
    warm = Harness()
    warm.step([request(0, prompt[:40], max_tokens=1)])  # caches the first 2 blocks
    warm.run_until_idle()
    admit = warm.step([request(1, prompt, max_tokens=1, mm_spans=spans)])
    warm.run_until_idle()
    assert matched(admit)[1].num_tokens == 32
    ends_cold = [e for _, e in _chunks(cold, 1)]
    ends_warm = [e for _, e in _chunks(warm, 1)]
    assert ends_warm == [e for e in ends_cold if e > 32]  # the same boundaries after the hit
    assert not _splits(_chunks(cold, 1), spans) and not _splits(_chunks(warm, 1), spans)


def test_an_attention_hit_never_ends_inside_a_multimodal_span() -> None:
    h = Harness()
    spans = (_span(32, 88),)
    prompt = tokens(90, seed=4)
    h.step([request(0, prompt, max_tokens=1, mm_spans=spans)])
    h.run_until_idle()  # 5 full blocks cached: the chain reaches 80, inside the span
    longer = np.concatenate([prompt, tokens(10, seed=5)])
    admit = h.step([request(1, longer, max_tokens=1, mm_spans=spans)])
    assert matched(admit)[1].num_tokens == 32  # rewound to the span's start
    assert prefills(admit) == [(1, 32, 88)]  # the span is computed whole


def test_an_mtp_hit_rewound_out_of_a_span_recomputes_from_the_span_start() -> None:
    h = Harness(num_speculative_tokens=1)
    spans = (_span(40, 60),)
    prompt = tokens(100, seed=6)
    h.step([request(0, prompt, max_tokens=1, mm_spans=spans)])
    h.run_until_idle()  # 6 full blocks cached
    admit = h.step([request(1, prompt[:70], max_tokens=1, mm_spans=spans)])
    hit = matched(admit)[1]
    # 4 cached blocks usable (69 // 16), the last one recomputed: 48 is inside [40, 60)
    assert (
        hit.num_tokens == 32 and hit.overlap_block == h.state.pool.index[h.state.seq(1).hashes[2]]
    )


def _looked_up(h: Harness, seq_id: int) -> ev.KVLookupStarted:
    return next(
        d for r in h.results for d in of_type(r.decisions, ev.KVLookupStarted) if d.seq_id == seq_id
    )


def test_a_load_from_the_store_never_ends_inside_a_multimodal_span() -> None:
    h = Harness(external_kv=True)
    spans = (_span(32, 88),)
    h.step([request(0, tokens(100, seed=7), max_tokens=1, mm_spans=spans)])
    assert _looked_up(h, 0).num_blocks == 6
    admit = h.step([ev.KVLookupAnswered(0, 5)])  # the store has 5 blocks: up to 80
    loads = of_type(admit.decisions, ev.KVLoadAdmitted)
    assert [(d.first_block, d.num_blocks) for d in loads] == [(0, 2)]  # ends at the span start


def test_a_failed_load_keeps_its_good_blocks_only_up_to_a_span_boundary() -> None:
    h = Harness(external_kv=True)
    spans = (_span(40, 70),)
    h.step([request(0, tokens(100, seed=8), max_tokens=1, mm_spans=spans)])
    admit = h.step([ev.KVLookupAnswered(0, 6)])
    assert [d.num_blocks for d in of_type(admit.decisions, ev.KVLoadAdmitted)] == [6]
    settle = h.step([ev.KVLoadFailed(0, 3, "store down")])  # 3 good blocks: up to 48
    assert [d.num_blocks for d in of_type(settle.decisions, ev.KVLoadSettled)] == [2]
    assert prefills(settle) == [(0, 32, 40)]  # then the span [40, 70) whole
    assert prefills(h.step()) == [(0, 40, 70)]


def test_a_hybrid_state_is_never_saved_inside_a_multimodal_span() -> None:
    h = Harness(hybrid=True, checkpoint_budget=8)  # kvsched's rules: prompt_tail at 80
    spans = (_span(70, 90),)
    h.step([request(0, tokens(90, seed=9), max_tokens=1, mm_spans=spans)])
    h.run_until_idle()
    saved = [d.num_tokens for r in h.results for d in of_type(r.decisions, ev.CheckpointReserved)]
    assert saved and not [s for s in saved if 70 < s < 90]


def test_a_prompt_tail_cut_never_splits_a_multimodal_span() -> None:
    h = Harness(hybrid=True, checkpoint_budget=8, **preset("vllm-align"))
    spans = (_span(70, 90),)
    h.step([request(0, tokens(90, seed=10), max_tokens=1, mm_spans=spans)])
    h.run_until_idle()
    assert _chunks(h, 0) == [(0, 64), (64, 90)]  # not cut at the tail boundary 80


def _embedded_per_step(h: Harness, spans: dict[int, tuple[ev.MultimodalSpan, ...]]) -> list[int]:
    """The span positions each step's chunks embed (spans starting inside a chunk)."""
    return [
        sum(s.end - s.start for q, a, b in prefills(r) for s in spans[q] if a <= s.start < b)
        for r in h.results
    ]


@pytest.mark.parametrize("budget", [0, 40, 70])
def test_the_encoder_budget_bounds_the_span_positions_one_step_embeds(budget: int) -> None:
    """Three requests with a 30-position image each (one with two), arriving together: with
    ``model.max_encoder_tokens`` no step embeds more than the budget, the chunks that would
    pass it wait for a later step (a chunk alone always runs), and every request
    finishes with the chunks it has without the budget."""
    model = ModelSpec(vocab_size=VOCAB, max_context=1024, max_encoder_tokens=budget)
    spans = {
        0: (_span(10, 40, b"a"),),
        1: (_span(5, 35, b"b"), _span(40, 70, b"c")),
        2: (_span(0, 30, b"d"),),
    }
    h = Harness(model=model, max_prefill_tokens=256)
    h.step([request(q, tokens(80, seed=10 + q), max_tokens=2, mm_spans=spans[q]) for q in spans])
    h.run_until_idle()
    embedded = _embedded_per_step(h, spans)
    assert sum(embedded) == 120
    if budget:
        assert max(embedded) <= max(budget, 60)  # (60: request 1's chunk alone)
        assert max(embedded) > budget or all(e <= budget for e in embedded)
        assert len([e for e in embedded if e]) > 1  # the budget spread them over steps
    else:
        assert embedded[0] == 120  # unbounded: all in the first step
    free = Harness(max_prefill_tokens=256)
    free.step([request(q, tokens(80, seed=10 + q), max_tokens=2, mm_spans=spans[q]) for q in spans])
    free.run_until_idle()
    assert sorted(_chunks(h, q) for q in spans) == sorted(_chunks(free, q) for q in spans)


def test_with_span_slices_chunks_hits_and_the_encoder_budget_follow_the_token_grid() -> None:
    """``model.span_slices`` (vLLM's runner keeps an item's encoder output across chunks):
    chunks end on the plain grid inside a span, a hit ends at its deepest cached block even
    inside a span (its blocks' identity names the span), and the encoder budget counts every
    span a chunk reaches, whole."""
    model = ModelSpec(vocab_size=VOCAB, max_context=1024, span_slices=True)
    h = Harness(model=model)  # 64-token chunks
    spans = (_span(50, 100),)
    prompt = tokens(150, seed=1)
    h.step([request(0, prompt, max_tokens=1, mm_spans=spans)])
    h.run_until_idle()
    assert _chunks(h, 0) == [(0, 64), (64, 128), (128, 150)]
    longer = np.concatenate([prompt[:90], tokens(30, seed=2)])
    admit = h.step([request(1, longer, max_tokens=1, mm_spans=spans)])
    assert matched(admit)[1].num_tokens == 80  # (block 5 ends inside the span)
    other = h.step([request(2, longer, max_tokens=1, mm_spans=(_span(50, 100, b"other"),))])
    assert matched(other)[2].num_tokens == 48  # (a different image: the blocks before it)
    assert spans_module.embedded(spans, 64, 128, whole=False) == 50
    assert spans_module.embedded(spans, 64, 128, whole=True) == 0


@pytest.mark.parametrize("budget", [0, 60])
def test_with_span_slices_a_span_a_chunk_stopped_inside_holds_its_encoder_budget(
    budget: int,
) -> None:
    """Request 0's first chunk stops inside its 60-position image (the executor keeps the
    image's encoder output for its next chunk); request 1, with a 10-position image, fits
    the step after token-wise, but 60 held + 10 pass the budget of 60: it waits until
    request 0's next chunk has finished the image (without a budget it does not wait)."""
    model = ModelSpec(
        vocab_size=VOCAB, max_context=1024, span_slices=True, max_encoder_tokens=budget
    )
    h = Harness(model=model)  # 64-token chunks and budget
    h.step([request(0, tokens(100, seed=7), max_tokens=1, mm_spans=(_span(40, 100, b"a"),))])
    h.step([request(1, tokens(20, seed=8), max_tokens=1, mm_spans=(_span(0, 10, b"b"),))])
    h.run_until_idle()
    first = {q: next(i for i, r in enumerate(h.results) if any(p[0] == q for p in prefills(r)))
             for q in (0, 1)}
    assert _chunks(h, 0) == [(0, 64), (64, 100)]
    assert first == {0: 0, 1: 2 if budget else 1}


@pytest.mark.parametrize(
    ("computed", "since", "held"),
    [
        (64, 64, 60),  # stopped inside [40, 100): held
        (100, 100, 0),  # finished it: released
        (100, 64, 60),  # finished it in a step still in flight: held until it lands
        (130, 100, 0),  # the step in flight reached no span
        (30, 30, 0),  # not reached yet
    ],
)
def test_the_encoder_positions_a_running_sequence_holds(computed, since, held) -> None:
    spans = (_span(40, 100), _span(120, 125))
    want = held + (5 if since < 125 and computed > 120 else 0)
    assert spans_module.held_positions(spans, computed, since) == want


def test_old_logs_let_chunks_split_multimodal_spans() -> None:
    legacy = SchedulerConfig.from_log_header({}, schema_version=3)
    assert not legacy.legacy.multimodal_safe
    assert SchedulerConfig.from_log_header({}, schema_version=4).legacy.multimodal_safe
    h = Harness(multimodal_safe=False)
    spans = (_span(50, 100),)
    h.step([request(0, tokens(150, seed=1), max_tokens=1, mm_spans=spans)])
    h.run_until_idle()
    assert _chunks(h, 0) == [(0, 64), (64, 128), (128, 150)]


@pytest.mark.parametrize(
    ("spans", "start", "end", "want"),
    [
        ((), 0, 64, 64),
        (((10, 30),), 0, 64, 64),  # a span inside the chunk
        (((50, 100),), 0, 64, 50),  # stop before the span
        (((50, 100),), 50, 64, 100),  # the span whole
        (((50, 100), (90, 130)), 50, 64, 130),  # overlapping spans count as one
        (((50, 100), (100, 180)), 100, 128, 180),  # adjacent spans stay apart
    ],
)
def test_a_chunk_end_is_the_grid_end_unless_it_splits_a_span(spans, start, end, want) -> None:
    from kvsched.policy.spans import chunk_end

    assert chunk_end(tuple(_span(a, b) for a, b in spans), start, end) == want
