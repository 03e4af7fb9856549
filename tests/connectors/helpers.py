"""Shared helpers for connector tests (also imported by the Mooncake agent)."""

from __future__ import annotations

import numpy as np

from kvsched.config import ModelSpec
from kvsched.connectors import (
    ConnectorInput,
    HostBlockBuffer,
    KVStore,
    StoreConnector,
    TransferEngine,
    block_key,
)
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
    """Save ``src`` blocks ``blocks`` under the chain's first ``len(blocks)`` keys, through a
    StoreConnector + TransferEngine (the production path)."""
    conn = StoreConnector(store, synchronous=True)
    engine = TransferEngine(store, src)
    n = len(blocks)
    inp = ConnectorInput(
        step=0,
        block_size=BLOCK_SIZE,
        seq_ids=np.array([1]),
        token_ends=np.array([n * BLOCK_SIZE]),
        block_counts=np.array([n]),
        block_ids=np.array(blocks),
        block_hashes=(tuple(hashes[:n]),),
        namespace_roots=(root,),
    )
    transfers = conn.build_step(inp)
    assert len(transfers.saves) == 1
    engine.apply(transfers)
    assert engine.wait_idle(30)
    report = engine.poll()
    assert report.finished_saves == {transfers.saves[0].save_id}, report
    engine.close()
    assert store.batch_exists([block_key(root, h) for h in hashes[:n]]) == [True] * n
