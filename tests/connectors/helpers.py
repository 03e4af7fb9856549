"""Shared helpers for connector tests (also imported by the Mooncake agent)."""

from __future__ import annotations

import numpy as np

from kvsched.config import ModelSpec
from kvsched.connectors import (
    HostBlockBuffer,
    KVStore,
    SaveOrder,
    StepTransfers,
    TransferEngine,
    block_key,
)
from kvsched.events.types import KVSaveStarted
from kvsched.identity import chain_hashes, namespace_root

BLOCK_SIZE = 16
BLOCK_BYTES = 4096


def chain(num_blocks: int, *, model: str = "tiny-qwen3.5", salt: str = "", seed: int = 0):
    """(namespace root, block hashes) of a random prompt of ``num_blocks`` full blocks."""
    root = namespace_root(ModelSpec(name=model), BLOCK_SIZE, salt=salt)
    tokens = np.random.default_rng(seed).integers(0, 32000, num_blocks * BLOCK_SIZE)
    return root, chain_hashes(root, tokens, BLOCK_SIZE)


def filled_buffer(num_blocks: int, seed: int = 1) -> HostBlockBuffer:
    buf = HostBlockBuffer(num_blocks, BLOCK_BYTES)
    buf.data[:] = np.random.default_rng(seed).integers(0, 256, buf.data.shape, dtype=np.uint8)
    return buf


def save_chain(
    store: KVStore, root: bytes, hashes: list[bytes], src: HostBlockBuffer, blocks: list[int]
) -> None:
    """Save ``src`` blocks ``blocks`` under the chain's first ``len(blocks)`` keys, as the
    engine's save decision orders it (the production path: ``SaveOrder.from_event``)."""
    engine = TransferEngine(store, src)
    n = len(blocks)
    decision = KVSaveStarted(0, 1, np.array(blocks, np.int32), 0, root, b"".join(hashes[:n]))
    transfers = StepTransfers(saves=(SaveOrder.from_event(decision),))
    engine.apply(transfers)
    assert engine.wait_idle(30)
    report = engine.poll()
    assert report.finished_saves == {transfers.saves[0].save_id}, report
    engine.close()
    assert store.batch_exists([block_key(root, h) for h in hashes[:n]]) == [True] * n
