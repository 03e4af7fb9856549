"""kvsched's cache as vLLM KV events (``integrations/vllm/kv_events.py``): the translator's
rules without vLLM, and a ZeroMQ subscriber of a hybrid run inside vLLM (needs vLLM)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import numpy as np
import pytest

from kvsched.events import types as ev
from kvsched.integrations.vllm.kv_events import EventGroups, KVEventTranslator
from kvsched.integrations.vllm.listen import Listener


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _factories() -> dict[str, type]:
    def make(kind: str) -> type:
        return lambda **kw: (kind, kw)  # type: ignore[return-value]

    return {k: make(k) for k in ("BlockStored", "BlockRemoved", "AllBlocksCleared")}


def _convert(b: bytes) -> int:
    return int.from_bytes(b, "big")


def _request() -> NS:
    return NS(block_hashes=[bytes([10]), bytes([11]), bytes([12])], all_token_ids=list(range(7)))


def test_vllm_kv_events_name_blocks_by_the_requests_hashes_and_skip_private_copies():
    tr = KVEventTranslator(2, _convert, _factories())
    cached = ev.BlocksCached(
        np.array([1], np.int64),
        np.array([3], np.int32),
        np.array([0], np.int32),
        np.array([4, 5, 6], np.int32),
        np.array([0, ev.PRIVATE_COPY, 0], np.int32),
        _h(1) + _h(2) + _h(3),
        b"\0" * 16 + _h(1) + _h(2),
    )
    events = tr.translate([cached], {1: _request()}.__getitem__)

    assert [
        (k, kw["block_hashes"], kw["parent_block_hash"], kw["token_ids"]) for k, kw in events
    ] == [
        ("BlockStored", [10], None, [0, 1]),
        ("BlockStored", [12], 11, [4, 5]),
    ]
    assert {(kw["group_idx"], kw["kv_cache_spec_kind"]) for _, kw in events} == {
        (0, "full_attention")
    }
    evicted = ev.BlocksEvicted(np.array([6], np.int32), _h(3))
    assert tr.translate([evicted], {}.__getitem__) == [
        ("BlockRemoved", {"block_hashes": [12], "medium": "GPU", "group_idx": 0})
    ]
    assert tr.translate([ev.CacheCleared()], {}.__getitem__) == [("AllBlocksCleared", {})]
    assert tr.names == {}


def _reserved(ckpt_id: int, num_tokens: int) -> ev.CheckpointReserved:
    return ev.CheckpointReserved(ckpt_id, 1, 3, num_tokens, _h(50 + ckpt_id), _h(1))


HYBRID = EventGroups(attention=3, mamba=(0, 1, 2))  # Qwen3-Next's layout: 3 mamba groups


def test_vllm_a_published_checkpoint_is_stored_per_mamba_group_named_by_the_hash_at_its_depth():
    tr = KVEventTranslator(2, _convert, _factories(), HYBRID)
    request_of = {1: _request()}.__getitem__

    assert tr.translate([_reserved(7, 4)], request_of) == []  # not saved yet: nothing to see
    events = tr.translate([ev.CheckpointPublished(7)], request_of)

    assert events == [
        (
            "BlockStored",
            {
                "block_hashes": [11],  # block_hashes[4 // 2 - 1]: the state after 4 tokens
                "parent_block_hash": 10,
                "token_ids": [2, 3],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": None,
                "group_idx": g,
                "kv_cache_spec_kind": "mamba",
                "session_id": None,
            },
        )
        for g in (0, 1, 2)
    ]
    assert tr.states == {7: 11}


def test_vllm_an_evicted_or_released_checkpoint_is_removed_from_each_mamba_group():
    tr = KVEventTranslator(2, _convert, _factories(), HYBRID)
    request_of = {1: _request()}.__getitem__
    tr.translate([_reserved(1, 2), _reserved(2, 6), _reserved(3, 4)], request_of)
    tr.translate([ev.CheckpointPublished(1), ev.CheckpointPublished(2)], request_of)

    evicted = tr.translate([ev.CheckpointEvicted(1)], request_of)
    released = tr.translate([ev.CheckpointReleased(2, "drain")], request_of)

    assert evicted == [
        ("BlockRemoved", {"block_hashes": [10], "medium": "GPU", "group_idx": g}) for g in (0, 1, 2)
    ]
    assert [kw["block_hashes"] for _, kw in released] == [[12]] * 3
    assert tr.translate([ev.CheckpointAbandoned(3, "superseded")], request_of) == []
    assert tr.states == {}


def test_vllm_a_cache_clear_withdraws_the_checkpoints_with_the_blocks():
    tr = KVEventTranslator(2, _convert, _factories(), HYBRID)
    request_of = {1: _request()}.__getitem__
    tr.translate([_reserved(1, 2), ev.CheckpointPublished(1)], request_of)

    assert tr.translate([ev.CacheCleared()], request_of) == [("AllBlocksCleared", {})]
    assert tr.states == {}
    assert tr.translate([ev.CheckpointReleased(1, "drain")], request_of) == []


def test_vllm_a_checkpoint_inside_a_block_cannot_be_named_and_is_refused():
    tr = KVEventTranslator(2, _convert, _factories(), HYBRID)
    with pytest.raises(ValueError, match="checkpoint 4 after 3 tokens is not block-aligned"):
        tr.translate([_reserved(4, 3)], {1: _request()}.__getitem__)


def test_vllm_stores_carry_the_extra_keys_of_their_blocks_as_vllm_computes_them():
    def salt(request: object, first: int, count: int, bs: int) -> list:
        return [("salt",) if i == 0 else None for i in range(first, first + count)]

    tr = KVEventTranslator(2, _convert, _factories(), HYBRID, salt)
    request_of = {1: _request()}.__getitem__
    cached = ev.BlocksCached(
        np.array([1], np.int64),
        np.array([2], np.int32),
        np.array([0], np.int32),
        np.array([4, 5], np.int32),
        np.array([0, 0], np.int32),
        _h(1) + _h(2),
        b"\0" * 16 + _h(1),
    )
    events = tr.translate([cached, _reserved(1, 2), ev.CheckpointPublished(1)], request_of)

    assert [kw["extra_keys"] for _, kw in events] == [[("salt",), None]] + [[("salt",)]] * 3


def test_vllm_an_attention_only_translator_publishes_no_checkpoints():
    tr = KVEventTranslator(2, _convert, _factories())
    request_of = {1: _request()}.__getitem__
    assert tr.translate([_reserved(1, 2), ev.CheckpointPublished(1)], request_of) == []


def test_vllm_cache_names_name_a_checkpoint_by_the_cached_block_its_identity_hashes():
    tr = KVEventTranslator(2, _convert, _factories(), HYBRID)
    request_of = {1: _request()}.__getitem__
    cached = ev.BlocksCached(
        np.array([1], np.int64),
        np.array([2], np.int32),
        np.array([0], np.int32),
        np.array([4, 5], np.int32),
        np.array([0, 0], np.int32),
        _h(1) + _h(2),
        b"\0" * 16 + _h(1),
    )
    tr.translate([cached], request_of)
    state = NS(pool=NS(index={_h(1): 4, _h(2): 5}), ckpts=NS(index={_h(2): 1}))  # after 4

    assert tr.cache_names(state) == {"blocks": ["10", "11"], "checkpoints": ["11"]}


# ---------------------------------------------------------------------- inside vLLM

TIMEOUT = 300


class Router:
    """What a hybrid-aware router rebuilds from vLLM's KV events: per KV cache group its
    block names, and each group's kind as its stores announce it."""

    def __init__(self) -> None:
        self.groups: dict[int, set[str]] = {}
        self.kinds: dict[int, str] = {}
        self.counts: dict[tuple[str, str], int] = {}

    def apply(self, e: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if isinstance(e, AllBlocksCleared):
            self.groups.clear()
            self._count("AllBlocksCleared", "")
            return
        assert e.group_idx is not None, e
        names = {str(h) for h in e.block_hashes}
        group = self.groups.setdefault(e.group_idx, set())
        if isinstance(e, BlockStored):
            assert e.kv_cache_spec_kind is not None
            self.kinds[e.group_idx] = e.kv_cache_spec_kind
            group |= names
        else:
            assert isinstance(e, BlockRemoved) and names <= group, e
            group -= names
        self._count(type(e).__name__, self.kinds[e.group_idx])

    def _count(self, kind: str, spec: str) -> None:
        self.counts[kind, spec] = self.counts.get((kind, spec), 0) + 1

    def of_kind(self, kind: str) -> list[set[str]]:
        return [self.groups.get(g, set()) for g, k in sorted(self.kinds.items()) if k == kind]


def test_vllm_kv_events_of_a_hybrid_run_rebuild_kvscheds_attention_index_and_checkpoints(
    tmp_path: Path,
):
    pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm (scripts/test_vllm.sh)")
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    from kvsched.integrations.vllm.models import build

    model = build("qwen3-next", tmp_path / "model")
    out = tmp_path / "kvsched.json"
    with Listener() as listener:
        args = ["--model", str(model), "--out", str(out), "--scheduler", "kvsched", "--hybrid"]
        args += ["--workload", "mixed", "--blocks", "33", "--batched-tokens", "2048"]
        args += ["--max-model-len", "4096", "--kv-events", listener.endpoint]
        args += ["--log", str(tmp_path / "run.kvlog")]
        proc = subprocess.run(
            [sys.executable, "-m", "kvsched.integrations.vllm.run", *args],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    messages = listener.messages
    assert proc.returncode == 0, proc.stderr[-4000:]
    mine = msgspec.json.decode(out.read_bytes())["kvsched"]

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)  # vLLM's own schema, strictly
    assert [seq for seq, _ in messages] == list(range(len(messages)))  # no gap
    router = Router()
    for _, payload in messages:
        for e in decoder.decode(payload).events:
            router.apply(e)

    (attention,) = router.of_kind("full_attention")
    states = router.of_kind("mamba")
    assert len(states) == 3 and states[0] == states[1] == states[2]  # one per mamba group
    assert attention == set(mine["cached_names"]) and attention
    assert states[0] == set(mine["checkpoint_names"]) and states[0]
    assert states[0] <= attention  # a state ends a cached prefix: its block's name
    # 33 vLLM blocks: 5 KV blocks and one checkpoint (3 mamba groups x (8 rows + 1) state
    # blocks): both are evicted; the workload resets the prefix cache once
    counts = router.counts
    assert counts.get(("BlockRemoved", "mamba"), 0) > 0, counts
    assert counts.get(("BlockRemoved", "full_attention"), 0) > 0, counts
    assert counts.get(("AllBlocksCleared", ""), 0) == 1, counts
    published, withdrawn = _checkpoint_decisions(tmp_path / "run.kvlog")
    assert counts["BlockStored", "mamba"] == 3 * published  # once per mamba group
    assert counts["BlockRemoved", "mamba"] == 3 * withdrawn


def _checkpoint_decisions(log: Path) -> tuple[int, int]:
    """How many checkpoints kvsched's log publishes, and evicts or releases before a reset
    (a reset's AllBlocksCleared withdraws what it releases after it)."""
    from kvsched.events.codec import decode_record
    from kvsched.events.log import read_log

    published = withdrawn = 0
    live: set[int] = set()
    for payload in read_log(log).records:
        for d in decode_record(payload).decisions:
            if isinstance(d, ev.CheckpointPublished):
                published += 1
                live.add(d.ckpt_id)
            elif isinstance(d, (ev.CheckpointEvicted, ev.CheckpointReleased)) and d.ckpt_id in live:
                withdrawn += 1
                live.discard(d.ckpt_id)
            elif isinstance(d, ev.CacheCleared):
                live.clear()
    return published, withdrawn
