"""connectors/buffers.py: host buffers for KV blocks and states, and a state's store value."""

from __future__ import annotations

import pytest

from kvsched.connectors.buffers import (
    HostBlockBuffer,
    HostStateBuffer,
    decode_state,
    encode_state,
)
from kvsched.connectors.errors import CorruptValueError


def test_a_state_value_decodes_to_the_conv_and_recurrent_bytes_it_was_made_of():
    assert decode_state(encode_state(b"conv", b"recurrent")) == (b"conv", b"recurrent")


@pytest.mark.parametrize("damage", ["short", "flipped", "cut"])
def test_a_damaged_state_value_is_a_corrupt_value_never_a_wrong_state(damage: str):
    value = bytearray(encode_state(b"conv", b"recurrent"))
    if damage == "short":
        value = value[:10]
    elif damage == "flipped":
        value[-1] ^= 1
    else:
        value = value[:-1]
    with pytest.raises(CorruptValueError):
        decode_state(bytes(value))


def test_a_block_written_reads_back_and_a_value_of_another_size_is_refused():
    buf = HostBlockBuffer(num_blocks=4, block_bytes=8)
    buf.write_block(2, bytes(range(8)))
    assert buf.read_block(2) == bytes(range(8)) and buf.read_block(1) == bytes(8)
    with pytest.raises(CorruptValueError, match="7 bytes"):
        buf.write_block(0, bytes(7))


def test_a_state_slot_written_reads_back_and_mismatched_sizes_are_refused():
    buf = HostStateBuffer(num_slots=2, conv_bytes=3, recurrent_bytes=5)
    buf.write_state(1, b"abc", b"defgh")
    assert buf.read_state(1) == (b"abc", b"defgh")
    with pytest.raises(CorruptValueError):
        buf.write_state(0, b"ab", b"defgh")
