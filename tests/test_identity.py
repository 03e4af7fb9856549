"""Block identity of multimodal prompts: which blocks a span's content hash marks, and what
that means for sharing KV between requests."""

from __future__ import annotations

import numpy as np
import pytest
from tests.policy.helpers import Harness, matched, of_type, request, tokens

from kvsched.events import types as ev
from kvsched.events.types import MultimodalSpan
from kvsched.identity import chain_hashes, namespace_root, span_extras

BS = 16


@pytest.mark.parametrize(
    ("start", "end", "blocks"),
    [
        (20, 28, [1]),  # inside one block, ending mid-block
        (16, 32, [1]),  # exactly one whole block
        (20, 32, [1]),  # ending exactly at a block end: the next block is not marked
        (20, 33, [1, 2]),  # one token into the next block marks it
        (0, 1, [0]),
        (15, 17, [0, 1]),
        (8, 64, [0, 1, 2, 3]),
    ],
)
def test_a_span_marks_exactly_the_blocks_holding_its_positions(
    start: int, end: int, blocks: list[int]
) -> None:
    extras = span_extras((MultimodalSpan(start, end, b"img"),), BS, 0, 8)
    assert extras == {b: b"img" for b in blocks}


def test_the_block_after_an_image_ending_at_a_block_end_has_the_identity_of_plain_tokens():
    image = MultimodalSpan(20, 32, b"cat-image-digest")
    prompt = tokens(60, seed=31)
    h = Harness()
    h.step([request(0, prompt, max_tokens=4, mm_spans=(image,))])
    results = h.run_until_idle()
    # The identities the engine gave the prompt's full blocks, as its event stream says.
    cached = [d for r in results for d in of_type(r.decisions, ev.BlocksCached)]
    chain = [x for d in cached for x in ev.split_hashes(d.hashes)][:3]
    root = namespace_root(h.config.model, BS)
    assert ev.split_hashes(cached[0].parents)[0] == root
    # Computed without span_extras: only block 1 holds image positions.
    digest = image.content_hash
    assert chain == chain_hashes(root, prompt, BS, 0, {1: digest})
    assert chain != chain_hashes(root, prompt, BS, 0, {1: digest, 2: digest})


@pytest.mark.parametrize(("content", "hit"), [(b"image-a", 48), (b"image-b", 16)])
def test_two_images_inside_one_block_share_its_kv_only_when_their_content_is_identical(
    content: bytes, hit: int
) -> None:
    prompt = tokens(60, seed=32)
    h = Harness()
    h.step([request(0, prompt, max_tokens=2, mm_spans=(MultimodalSpan(20, 28, b"image-a"),))])
    h.run_until_idle()
    result = h.step([request(1, prompt, mm_spans=(MultimodalSpan(20, 28, content),))])
    # Block 0 precedes the image: shared whatever the image; from block 1 on only the same one.
    assert matched(result)[1].num_tokens == hit


def test_a_block_filled_by_outputs_after_an_image_keeps_the_images_content_hash():
    """The prompt's last block holds the end of an image and is filled by sampled tokens:
    its identity includes the image's content hash, as a prompt block's would, so two
    requests whose images differ never share that block."""
    image = MultimodalSpan(36, 40, b"cat-image-digest")  # positions 36..39 of block 2
    prompt = tokens(40, seed=33)
    h = Harness()
    h.step([request(0, prompt, max_tokens=12, mm_spans=(image,))])
    results = h.run_until_idle()
    cached = [d for r in results for d in of_type(r.decisions, ev.BlocksCached)]
    chain = [x for d in cached for x in ev.split_hashes(d.hashes)]
    assert len(chain) == 3  # block 2 (tokens 32..47) is filled by the first 8 outputs
    # Each decode step's input is the token sampled by the step before it.
    outputs = [int(r.plan.input_ids[0]) for r in results if r.plan.num_decode_tokens]
    block_tokens = np.asarray([*prompt[:40], *outputs[:8]], np.int32)
    root = namespace_root(h.config.model, BS)
    assert chain == chain_hashes(root, block_tokens, BS, 0, {2: image.content_hash})
    assert chain[2] != chain_hashes(root, block_tokens, BS)[2]
