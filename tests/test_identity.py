"""Block identity: the kvs128 kernel against its specification, stability across processes,
salts, schemes, caller digests; multimodal prompts (which blocks a span's content hash marks,
and what that means for sharing KV between requests)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.policy.helpers import Harness, matched, of_type, request, tokens

from kvsched import identity
from kvsched.config import ModelSpec, SchedulerConfig
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


# ---------------------------------------------------------------- the kvs128 scheme


def _paths() -> list[str]:
    """The kernel's lane loops this CPU runs (each must compute the specification)."""
    out = []
    for name in ("avx2", "sse2", "scalar"):
        try:
            identity._kvs128.use(name)
            out.append(name)
        except ValueError:
            pass
    identity._kvs128.use(None)
    return out


def test_the_native_kvs128_kernel_has_a_portable_loop_and_picks_the_fastest_by_default() -> None:
    assert identity._kvs128 is not None, "the native kernel is not built"
    assert "scalar" in _paths()
    assert identity._kvs128.use(None) == _paths()[0]
    with pytest.raises(ValueError, match="not available"):
        identity._kvs128.use("no-such-path")


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.integers(1, 80),
    n_tokens=st.integers(0, 400),
    extra_blocks=st.lists(st.tuples(st.integers(0, 6), st.binary(max_size=70)), max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_native_kvs128_kernel_computes_exactly_its_python_specification(
    block_size: int, n_tokens: int, extra_blocks: list[tuple[int, bytes]], seed: int
) -> None:
    assert identity._kvs128 is not None, "the native kernel is not built"
    root = namespace_root(ModelSpec(), block_size)
    keys = identity.kvs128_keys(root)
    toks = np.random.default_rng(seed).integers(-(2**31), 2**31, n_tokens).astype("<i4")
    extras = sorted(dict(extra_blocks).items())
    extras = [(b, x) for b, x in extras if x]
    reference = identity._kvs128_py(root, toks.tobytes(), block_size, keys, extras)
    assert len(reference) == 16 * (n_tokens // block_size)
    try:
        for path in _paths():
            identity._kvs128.use(path)
            native = identity._kvs128.chain(root, toks, block_size, keys, extras or None)
            assert native == reference, path
    finally:
        identity._kvs128.use(None)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=5000), parent=st.binary(min_size=16, max_size=16))
def test_the_native_kvs128_digest_of_any_bytes_computes_its_python_specification(
    data: bytes, parent: bytes
) -> None:
    keys = identity.kvs128_keys(identity.kvs128_root())
    reference = identity._kvs128_digest_py(parent, data, keys)
    try:
        for path in _paths():
            identity._kvs128.use(path)
            assert identity._kvs128.digest(parent, data, keys) == reference, path
    finally:
        identity._kvs128.use(None)
    # zero padding never makes two lengths collide
    assert identity._kvs128_digest_py(parent, data + b"\0", keys) != reference


# Computed once by the Python specification; any change to the scheme changes it (and every
# store key and logged digest with it: such a change needs a new scheme name).
PINNED = "7b0c3c1544492e6e5056f05289b9b3f3"


def _pinned_chain() -> list[bytes]:
    root = namespace_root(ModelSpec(name="pinned-model"), 16, adapter="a", salt="s")
    return chain_hashes(root, np.arange(64, dtype=np.int32) * 7919 % 150_000, 16)


def test_a_kvs128_digest_is_the_same_in_another_process_and_pinned_across_machines() -> None:
    code = "from tests.test_identity import _pinned_chain; print(b''.join(_pinned_chain()).hex())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()
    here = b"".join(_pinned_chain()).hex()
    assert other == here
    assert here[-32:] == PINNED


def test_a_prompt_has_the_same_block_identity_whole_or_split_into_session_turns() -> None:
    h = Harness()
    first = tokens(37, seed=41)  # turn boundaries fall inside blocks
    h.step([request(0, first, max_tokens=3, session_id=5)])
    h.run_until_idle()
    second = tokens(29, seed=42)
    h.step([request(1, second, max_tokens=1, session_id=5)])
    turn = h.state.seq(1)
    whole = turn.token_view().copy()  # first turn, its outputs, the second turn
    assert len(whole) == 37 + 3 + 29
    fresh = Harness()
    fresh.step([request(2, whole, max_tokens=1)])
    alone = fresh.state.seq(2)
    assert turn.hashes == alone.hashes
    assert len(turn.hashes) == len(whole) // BS
    assert turn.hashes == chain_hashes(namespace_root(h.config.model, BS), whole, BS)


def test_the_cache_salt_and_the_scheme_each_change_every_digest_of_a_prompt() -> None:
    model, prompt = ModelSpec(), tokens(64, seed=43)
    plain = chain_hashes(namespace_root(model, BS), prompt, BS)
    salted_root = namespace_root(model, BS, salt="tenant-b")
    salted = chain_hashes(salted_root, prompt, BS)
    root_b2 = namespace_root(model, BS, scheme="blake2b")
    blake = chain_hashes(root_b2, prompt, BS, scheme="blake2b")
    assert len(plain) == len(salted) == len(blake) == 4
    assert not set(plain) & set(salted) and not set(plain) & set(blake)


def test_an_engine_configured_for_blake2b_hashes_blocks_as_logs_before_schema_4_did() -> None:
    from hashlib import blake2b

    h = Harness(identity="blake2b")
    prompt = tokens(40, seed=44)
    h.step([request(0, prompt, max_tokens=1)])
    root = namespace_root(h.state.config.model, BS, "", "", "blake2b")
    first = blake2b(root, digest_size=16)
    first.update(prompt[:BS].astype("<i4").tobytes())
    assert h.state.seq(0).hashes[0] == first.digest()
    legacy = SchedulerConfig.from_log_header({"block_size": BS}, schema_version=3)
    assert legacy.identity == "blake2b"
    assert SchedulerConfig.from_log_header({}, schema_version=4).identity == "kvs128"


def test_block_digests_given_with_a_request_are_used_and_the_chain_continues_from_them() -> None:
    h = Harness()
    prompt = tokens(56, seed=45)  # 3 full blocks
    given_hashes = bytes(range(16)) + bytes(range(16, 32))  # the caller's first 2 blocks
    h.step([request(0, prompt, max_tokens=1, block_hashes=given_hashes)])
    seq = h.state.seq(0)
    assert seq.hashes[0] == given_hashes[:16] and seq.hashes[1] == given_hashes[16:]
    root = namespace_root(h.state.config.model, BS)
    rest = chain_hashes(root, prompt[2 * BS : 3 * BS], BS, 2, parent=given_hashes[16:])
    assert seq.hashes[2] == rest[0]
    # The same prompt with the same caller digests hits its blocks; without them it does not.
    h.run_until_idle()
    again = h.step([request(1, prompt, max_tokens=1, block_hashes=given_hashes)])
    assert matched(again)[1].num_tokens == 48
    other = h.step([request(2, prompt, max_tokens=1)])
    assert matched(other)[2].num_tokens == 0


@pytest.mark.parametrize(
    ("digests", "why"),
    [(b"\x01" * 15, "whole 16-byte digests"), (b"\x01" * 64, "more blocks")],
)
def test_caller_digests_that_are_not_whole_or_name_too_many_blocks_are_refused(
    digests: bytes, why: str
) -> None:
    from kvsched.reducers.inputs import MalformedInput

    h = Harness()
    arrival = request(0, tokens(40, seed=46), max_tokens=1, block_hashes=digests)
    if len(digests) % 16:
        with pytest.raises(MalformedInput, match=why):
            h.step([arrival])
    else:
        result = h.step([arrival])
        rejected = [d for d in result.decisions if isinstance(d, ev.RequestRejected)]
        assert rejected and why in rejected[0].reason


def test_a_hash_chain_reads_packed_and_appended_digests_as_one_sequence() -> None:
    d = [bytes([i]) * 16 for i in range(6)]
    chain = identity.HashChain(b"".join(d[:4]))
    chain.append(d[4])
    chain.append(d[5])
    assert len(chain) == 6 and list(chain) == d and chain == d
    assert chain[3] == d[3] and chain[4] == d[4] and chain[-1] == d[5] and chain[-6] == d[0]
    with pytest.raises(IndexError):
        chain[-7]
    assert chain.packed(2, 5) == b"".join(d[2:5]) and chain.packed(5) == d[5]
    assert chain.prefix(5) == d[:5] and chain.prefix(2) == d[:2]
    assert chain.extended(b"".join(d[:1])) == [*d, d[0]]
    assert chain.last(b"root") == d[5] and identity.HashChain().last(b"root") == b"root"
    # Binary search of the longest prefix in a prefix-closed index, across both parts.
    for k in range(7):
        index = set(d[:k])
        assert chain.longest_prefix_in(index, 6) == k
        assert chain.longest_prefix_in(index, 3) == min(k, 3)
    with pytest.raises(ValueError, match="whole"):
        identity.HashChain(b"x" * 15)


@pytest.mark.parametrize("block_size", [16, 64, 80, 128])
@pytest.mark.parametrize("n_tokens", [0, 15, 64, 1000, 4099])
def test_the_kernels_whole_chain_loop_for_whole_stripes_computes_the_specification_and_max(
    block_size: int, n_tokens: int
) -> None:
    """Block sizes of whole 64-byte stripes without extras take the AVX2 path's one-loop chain
    (where the CPU has AVX2): digests and the unsigned max of every token, tail included."""
    assert identity._kvs128 is not None, "the native kernel is not built"
    root = namespace_root(ModelSpec(), block_size)
    keys = identity.kvs128_keys(root)
    toks = np.random.default_rng(n_tokens).integers(-(2**31), 2**31, n_tokens).astype("<i4")
    if n_tokens > 100:
        toks[-1] = -1  # the largest unsigned id, past the last full block
    reference = identity._kvs128_py(root, toks.tobytes(), block_size, keys, [])
    top = int(toks.view("<u4").max()) if n_tokens else 0
    try:
        for path in _paths():
            identity._kvs128.use(path)
            assert identity._kvs128.chain(root, toks, block_size, keys, None, True) == (
                reference,
                top,
            ), path
    finally:
        identity._kvs128.use(None)


@pytest.mark.parametrize("scheme", ["kvs128", "blake2b"])
def test_a_chain_continued_from_a_later_block_puts_each_spans_extras_on_its_own_blocks(
    scheme: str,
) -> None:
    """Extras are keyed by absolute block index: continuing a chain from block 2 (a session's
    next turn, a load's first block) gives the digests of the whole chain."""
    bs, prompt = 4, tokens(24, seed=7)
    images = [MultimodalSpan(9, 14, b"i" * 16), MultimodalSpan(20, 22, b"j" * 16)]
    extras = span_extras(images, bs, 0, 6)
    root = namespace_root(ModelSpec(), bs)
    whole = identity.chain_packed(scheme, root, root, prompt, bs, 0, extras)
    rest = identity.chain_packed(scheme, root, whole[16:32], prompt[8:], bs, 2, extras)
    assert rest == whole[32:], "a continued chain put the extras on other blocks"
