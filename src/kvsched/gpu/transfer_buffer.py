"""``TorchCacheBuffer``: a :class:`TorchExecutor`'s paged cache as the connectors' buffers.

It satisfies ``connectors.protocol.BlockBuffer`` and ``StateBuffer``, so a
``connectors.TransferEngine`` can save KV blocks and state checkpoints from the executor's
cache to a ``KVStore`` and load them back into another executor's cache::

    engine = TransferEngine(store, buf := TorchCacheBuffer(executor), buf)

Value layout (raw bytes, native byte order, the cache's dtypes):

* a block value is K then V of the block in every attention layer:
  ``key_all[:, b]`` (``[n_attn, block_size, kv_heads, head_dim]``, C order) followed by
  ``value_all[:, b]``; ``block_bytes = 2 * n_attn * block_size * kv_heads * head_dim *
  itemsize``;
* a state is ``(conv, recurrent)``: ``conv_all[:, s]`` (``[n_linear, conv_dim, K-1]``, model
  dtype) and ``recurrent_all[:, s]`` (``[n_linear, Hv, dk, dv]``, float32); the transfer
  engine wraps the pair with ``connectors.buffers.encode_state``.

Only executors with the same model config, cache dtype and block size can share values; the
store keys (``connectors.keys``, namespaced by ``identity.namespace_root``) keep others apart.

Block 0 and slot 0 are the null block and slot: they can be read but never written. A value
of the wrong size raises ``CorruptValueError`` (the engine reports the load as failed).
Reads and writes are not synchronised with ``execute``: the caller (the scheduler) keeps the
blocks and slots of an in-flight transfer out of every plan until the transfer is reported.
"""

from __future__ import annotations

import numpy as np
import torch

from kvsched.connectors.errors import CorruptValueError
from kvsched.gpu.cache import PagedCache
from kvsched.gpu.torch_executor import TorchExecutor

__all__ = ["TorchCacheBuffer"]


def _to_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw: np.ndarray = flat.view(torch.uint8).numpy()
    return raw.tobytes()


def _from_bytes(data: bytes, like: torch.Tensor) -> torch.Tensor:
    """``data`` as a CPU tensor of ``like``'s dtype and shape (the caller checked the size)."""
    if not data:  # no layers of this kind (e.g. an attention-only model's state)
        return torch.empty(like.shape, dtype=like.dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(like.dtype).reshape(like.shape)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TorchCacheBuffer:
    """The KV blocks and state slots of ``executor.cache`` as ``BlockBuffer`` and
    ``StateBuffer``."""

    def __init__(self, executor: TorchExecutor) -> None:
        self.executor = executor
        cache: PagedCache = executor.cache
        self.cache = cache
        self._kv_bytes = _nbytes(cache.key_all[:, 0])
        self._conv_bytes = _nbytes(cache.conv_all[:, 0])
        self._recurrent_bytes = _nbytes(cache.recurrent_all[:, 0])

    # ------------------------------------------------------------------ BlockBuffer

    @property
    def block_bytes(self) -> int:
        return 2 * self._kv_bytes

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def _block(self, block_id: int, write: bool) -> int:
        b = int(block_id)
        lo = 1 if write else 0
        if not lo <= b < self.cache.num_blocks:
            raise ValueError(f"block {b} out of range [{lo}, {self.cache.num_blocks})")
        return b

    def read_block(self, block_id: int) -> bytes:
        b = self._block(block_id, write=False)
        return _to_bytes(self.cache.key_all[:, b]) + _to_bytes(self.cache.value_all[:, b])

    def write_block(self, block_id: int, data: bytes) -> None:
        b = self._block(block_id, write=True)
        if len(data) != self.block_bytes:
            raise CorruptValueError(
                f"block value is {len(data)} bytes, the cache's blocks are {self.block_bytes}"
            )
        n = self._kv_bytes
        key, value = self.cache.key_all[:, b], self.cache.value_all[:, b]
        k = _from_bytes(data[:n], key)
        v = _from_bytes(data[n:], value)
        with torch.no_grad():
            key.copy_(k)
            value.copy_(v)

    # ------------------------------------------------------------------ StateBuffer

    def _slot(self, slot: int, write: bool) -> int:
        s = int(slot)
        lo = 1 if write else 0
        if not lo <= s < self.cache.num_state_slots:
            raise ValueError(f"state slot {s} out of range [{lo}, {self.cache.num_state_slots})")
        return s

    def read_state(self, slot: int) -> tuple[bytes, bytes]:
        s = self._slot(slot, write=False)
        return _to_bytes(self.cache.conv_all[:, s]), _to_bytes(self.cache.recurrent_all[:, s])

    def write_state(self, slot: int, conv: bytes, recurrent: bytes) -> None:
        s = self._slot(slot, write=True)
        if len(conv) != self._conv_bytes or len(recurrent) != self._recurrent_bytes:
            raise CorruptValueError(
                f"state sizes {len(conv)}/{len(recurrent)} do not match the slots "
                f"{self._conv_bytes}/{self._recurrent_bytes}"
            )
        conv_t, rec_t = self.cache.conv_all[:, s], self.cache.recurrent_all[:, s]
        c = _from_bytes(conv, conv_t)
        r = _from_bytes(recurrent, rec_t)
        with torch.no_grad():
            conv_t.copy_(c)
            rec_t.copy_(r)
