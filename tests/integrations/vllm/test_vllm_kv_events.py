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


def _mamba(names: list[int], parent: int | None, tokens: list[int], g: int) -> tuple:
    return (
        "BlockStored",
        {
            "block_hashes": names,
            "parent_block_hash": parent,
            "token_ids": tokens,
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


def _removed(names: list[int], g: int) -> tuple:
    return ("BlockRemoved", {"block_hashes": names, "medium": "GPU", "group_idx": g})


def _published(tr: KVEventTranslator, *depths: tuple[int, int]) -> list:
    """Reserve and publish checkpoints ``(ckpt_id, num_tokens)`` of the 3-block request."""
    request_of = {1: _request()}.__getitem__
    tr.translate([_reserved(i, n) for i, n in depths], request_of)
    return tr.translate([ev.CheckpointPublished(i) for i, _ in depths], request_of)


def test_vllm_a_published_checkpoint_is_its_chain_in_group_0_and_its_block_in_other_groups():
    tr = KVEventTranslator(2, _convert, _factories(), HYBRID)
    request_of = {1: _request()}.__getitem__

    assert tr.translate([_reserved(7, 4)], request_of) == []  # not saved yet: nothing to see
    events = tr.translate([ev.CheckpointPublished(7)], request_of)

    assert events == [
        _mamba([10, 11], None, [0, 1, 2, 3], 0),  # the router's group: blocks 0..1, no parent
        # block_hashes[4 // 2 - 1]: the state after 4 tokens, its block and its parent
        _mamba([11], 10, [2, 3], 1),
        _mamba([11], 10, [2, 3], 2),
    ]
    assert tr.states == {7: 11}
    assert tr.covered == {10: 1, 11: 1}


def test_vllm_a_chain_block_is_withdrawn_only_when_no_live_checkpoint_covers_it():
    tr = KVEventTranslator(2, _convert, _factories(), HYBRID)
    request_of = {1: _request()}.__getitem__
    stores = _published(tr, (1, 2), (2, 6), (3, 4))  # after blocks 0, 2 and 1: one chain

    assert [kw["block_hashes"] for _, kw in stores[::3]] == [[10], [10, 11, 12], [10, 11]]
    assert tr.covered == {10: 3, 11: 2, 12: 1}
    assert tr.translate([ev.CheckpointEvicted(1)], request_of) == [
        _removed([10], 1),  # the shallowest state goes: deeper ones still cover its block
        _removed([10], 2),
    ]
    assert tr.translate([ev.CheckpointReleased(2, "drain")], request_of) == [
        _removed([12], 0),  # only block 2 is left without a state at or beyond it
        _removed([12], 1),
        _removed([12], 2),
    ]
    assert tr.translate([ev.CheckpointEvicted(3)], request_of)[0] == _removed([11, 10], 0)
    assert tr.states == tr.chains == tr.covered == {}


def test_vllm_an_evicted_or_released_checkpoint_is_removed_from_each_mamba_group():
    tr = KVEventTranslator(2, _convert, _factories(), HYBRID)
    request_of = {1: _request()}.__getitem__
    tr.translate([_reserved(1, 2), _reserved(2, 6), _reserved(3, 4)], request_of)
    tr.translate([ev.CheckpointPublished(1), ev.CheckpointPublished(2)], request_of)

    evicted = tr.translate([ev.CheckpointEvicted(2)], request_of)
    released = tr.translate([ev.CheckpointReleased(1, "drain")], request_of)

    assert evicted == [_removed([12, 11], 0), _removed([12], 1), _removed([12], 2)]
    assert released == [_removed([10], g) for g in (0, 1, 2)]
    assert tr.translate([ev.CheckpointAbandoned(3, "superseded")], request_of) == []
    assert tr.states == tr.covered == {}


def test_vllm_a_cache_clear_withdraws_the_checkpoints_with_the_blocks():
    tr = KVEventTranslator(2, _convert, _factories(), HYBRID)
    request_of = {1: _request()}.__getitem__
    _published(tr, (1, 4))

    assert tr.translate([ev.CacheCleared()], request_of) == [("AllBlocksCleared", {})]
    assert tr.states == tr.chains == tr.covered == {}
    assert tr.translate([ev.CheckpointReleased(1, "drain")], request_of) == []
    assert _published(tr, (2, 2))[0] == _mamba([10], None, [0, 1], 0)  # counted afresh
    assert tr.covered == {10: 1}


def test_vllm_a_model_whose_only_mamba_group_is_0_gets_the_chains_alone():
    tr = KVEventTranslator(2, _convert, _factories(), EventGroups(attention=1, mamba=(0,)))
    request_of = {1: _request()}.__getitem__

    assert _published(tr, (1, 4), (2, 6)) == [
        _mamba([10, 11], None, [0, 1, 2, 3], 0),
        _mamba([10, 11, 12], None, [0, 1, 2, 3, 4, 5], 0),
    ]
    assert tr.translate([ev.CheckpointEvicted(1)], request_of) == []  # still covered
    assert tr.translate([ev.CheckpointEvicted(2)], request_of) == [_removed([12, 11, 10], 0)]


def test_vllm_mamba_groups_other_than_0_get_no_chains():
    tr = KVEventTranslator(2, _convert, _factories(), EventGroups(attention=0, mamba=(1, 2)))
    request_of = {1: _request()}.__getitem__

    assert _published(tr, (1, 4)) == [_mamba([11], 10, [2, 3], g) for g in (1, 2)]
    assert tr.covered == {}
    assert tr.translate([ev.CheckpointEvicted(1)], request_of) == [
        _removed([11], g) for g in (1, 2)
    ]


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
    events = _published(tr, (2, 4))  # the chain carries every block's keys, the block its own
    assert [kw["extra_keys"] for _, kw in events] == [[("salt",), None], [None], [None]]


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
    block names, each group's kind as its stores announce it, every store's names by its
    last name (a chain by the checkpoint ending it), and the events per (kind, group)."""

    def __init__(self) -> None:
        self.groups: dict[int, set[str]] = {}
        self.kinds: dict[int, str] = {}
        self.chains: dict[int, dict[str, list[str]]] = {}
        self.counts: dict[tuple[str, int | None], int] = {}

    def apply(self, e: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if isinstance(e, AllBlocksCleared):
            self.groups.clear()
            self._count("AllBlocksCleared", None)
            return
        assert e.group_idx is not None, e
        names = [str(h) for h in e.block_hashes]
        group = self.groups.setdefault(e.group_idx, set())
        if isinstance(e, BlockStored):
            assert e.kv_cache_spec_kind is not None
            self.kinds[e.group_idx] = e.kv_cache_spec_kind
            self.chains.setdefault(e.group_idx, {})[names[-1]] = names
            group |= set(names)
        else:
            assert isinstance(e, BlockRemoved) and set(names) <= group, e
            group -= set(names)
        self._count(type(e).__name__, e.group_idx)

    def _count(self, kind: str, group: int | None) -> None:
        self.counts[kind, group] = self.counts.get((kind, group), 0) + 1


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

    assert router.kinds == {0: "mamba", 1: "mamba", 2: "mamba", 3: "full_attention"}
    attention, checkpoints = set(mine["cached_names"]), set(mine["checkpoint_names"])
    assert router.groups[3] == attention and attention
    assert router.groups[1] == router.groups[2] == checkpoints and checkpoints  # one block each
    assert checkpoints <= attention  # a state ends a cached prefix: its block's name
    # group 0 (the one vllm-router scores): the chain of every live checkpoint, nothing else
    chains = router.chains[0]
    assert all(chains[c][-1] == c for c in checkpoints)
    assert router.groups[0] == set().union(*(chains[c] for c in checkpoints))
    # 33 vLLM blocks: 5 KV blocks and one checkpoint (3 mamba groups x (8 rows + 1) state
    # blocks): both are evicted; the workload resets the prefix cache once
    counts = router.counts
    assert counts.get(("BlockRemoved", 3), 0) > 0, counts
    assert counts.get(("BlockRemoved", 0), 0) > 0, counts
    assert counts.get(("AllBlocksCleared", None), 0) == 1, counts
    published, withdrawn = _checkpoint_decisions(tmp_path / "run.kvlog")
    assert [counts["BlockStored", g] for g in (0, 1, 2)] == [published] * 3
    assert [counts["BlockRemoved", g] for g in (1, 2)] == [withdrawn] * 2
    assert counts["BlockRemoved", 0] <= withdrawn  # (not when a deeper state still covers)


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
