"""Host-memory block and state buffers (tests, simulated executor) and the state value format.

``HostBlockBuffer`` is a numpy ``[num_blocks, block_bytes]`` uint8 array; ``HostStateBuffer``
holds per-slot conv and recurrent state. Both satisfy the ``BlockBuffer`` / ``StateBuffer``
protocols, which the torch executor implements over its own tensors.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from kvsched.connectors.errors import CorruptValueError

__all__ = ["HostBlockBuffer", "HostStateBuffer", "decode_state", "encode_state"]

_STATE_MAGIC = b"KVST"
_STATE_HEADER = struct.Struct("<4sHQQI")  # magic, version, conv len, recurrent len, crc32


def encode_state(conv: bytes, recurrent: bytes) -> bytes:
    """A state checkpoint as one store value: header (sizes, crc32 of the payload) + bytes."""
    payload = bytes(conv) + bytes(recurrent)
    header = _STATE_HEADER.pack(_STATE_MAGIC, 1, len(conv), len(recurrent), zlib.crc32(payload))
    return header + payload


def decode_state(value: bytes) -> tuple[bytes, bytes]:
    """Inverse of :func:`encode_state`; raises ``CorruptValueError`` on any mismatch."""
    if len(value) < _STATE_HEADER.size:
        raise CorruptValueError(f"state value too short ({len(value)} bytes)")
    magic, version, nconv, nrec, crc = _STATE_HEADER.unpack_from(value)
    if magic != _STATE_MAGIC or version != 1:
        raise CorruptValueError(f"not a state checkpoint (magic {magic!r}, version {version})")
    payload = value[_STATE_HEADER.size :]
    if len(payload) != nconv + nrec:
        raise CorruptValueError(
            f"state payload is {len(payload)} bytes, header says {nconv + nrec}"
        )
    if zlib.crc32(payload) != crc:
        raise CorruptValueError("state checksum mismatch")
    return payload[:nconv], payload[nconv:]


class HostBlockBuffer:
    """``num_blocks`` blocks of ``block_bytes`` bytes in one numpy array."""

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        if num_blocks < 1 or block_bytes < 1:
            raise ValueError("num_blocks and block_bytes must be positive")
        self.data = np.zeros((num_blocks, block_bytes), dtype=np.uint8)

    @property
    def block_bytes(self) -> int:
        return int(self.data.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[0])

    def read_block(self, block_id: int) -> bytes:
        data: bytes = self.data[block_id].tobytes()
        return data

    def write_block(self, block_id: int, data: bytes) -> None:
        if len(data) != self.block_bytes:
            raise CorruptValueError(
                f"block value is {len(data)} bytes, the buffer's blocks are {self.block_bytes}"
            )
        self.data[block_id] = np.frombuffer(data, dtype=np.uint8)


class HostStateBuffer:
    """``num_slots`` state slots: conv state (``conv_bytes``) and recurrent state
    (``recurrent_bytes``) per slot."""

    def __init__(self, num_slots: int, conv_bytes: int, recurrent_bytes: int) -> None:
        self.conv = np.zeros((num_slots, conv_bytes), dtype=np.uint8)
        self.recurrent = np.zeros((num_slots, recurrent_bytes), dtype=np.uint8)

    def read_state(self, slot: int) -> tuple[bytes, bytes]:
        conv: bytes = self.conv[slot].tobytes()
        recurrent: bytes = self.recurrent[slot].tobytes()
        return conv, recurrent

    def write_state(self, slot: int, conv: bytes, recurrent: bytes) -> None:
        if len(conv) != self.conv.shape[1] or len(recurrent) != self.recurrent.shape[1]:
            raise CorruptValueError(
                f"state sizes {len(conv)}/{len(recurrent)} do not match the slots "
                f"{self.conv.shape[1]}/{self.recurrent.shape[1]}"
            )
        self.conv[slot] = np.frombuffer(conv, dtype=np.uint8)
        self.recurrent[slot] = np.frombuffer(recurrent, dtype=np.uint8)
