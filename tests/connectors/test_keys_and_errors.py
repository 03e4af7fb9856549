from __future__ import annotations

import pytest

from kvsched.connectors import (
    InvalidRequest,
    LeaseHeld,
    NoSpace,
    RpcFailed,
    StoreError,
    StoreUnavailable,
    TransferFailed,
    block_key,
    mooncake_error,
    namespace_prefix,
    parse_key,
    state_key,
)
from kvsched.connectors.buffers import decode_state, encode_state
from kvsched.connectors.errors import CorruptValueError

from .helpers import chain


def test_keys_of_two_models_or_two_salts_never_collide_for_the_same_tokens() -> None:
    deployments = [chain(8), chain(8, model="other-model"), chain(8, salt="tenant-b")]
    roots = {root for root, _ in deployments}
    assert len(roots) == 3
    keys = [block_key(r, h) for r, hs in deployments for h in hs]
    keys += [state_key(r, h) for r, hs in deployments for h in hs]
    assert len(set(keys)) == len(keys)


def test_keys_carry_the_namespace_root_even_for_an_identical_block_hash() -> None:
    (root_a, hashes), (root_b, _) = chain(2), chain(2, salt="x")
    h = hashes[0]
    assert block_key(root_a, h) != block_key(root_b, h)
    assert block_key(root_a, h).startswith(namespace_prefix(root_a))
    assert block_key(root_a, h) != state_key(root_a, h)


def test_keys_parse_back_into_root_kind_and_hash() -> None:
    root, hashes = chain(1)
    assert parse_key(block_key(root, hashes[0])) == (root, "kv", hashes[0])
    assert parse_key(state_key(root, hashes[0])) == (root, "st", hashes[0])
    with pytest.raises(ValueError):
        parse_key("something/else")
    with pytest.raises(ValueError):
        block_key(root, b"short")


@pytest.mark.parametrize(
    ("code", "cls", "name"),
    [
        (-200, NoSpace, "NO_AVAILABLE_HANDLE"),
        (-600, InvalidRequest, "INVALID_PARAMS"),
        (-706, LeaseHeld, "OBJECT_HAS_LEASE"),
        (-800, TransferFailed, "TRANSFER_FAIL"),
        (-900, RpcFailed, "RPC_FAIL"),
        (-901, RpcFailed, "RPC_TIMEOUT"),
        (-12345, StoreError, "UNKNOWN"),
    ],
)
def test_mooncake_codes_map_to_typed_errors_with_code_and_name(
    code: int, cls: type[StoreError], name: str
) -> None:
    err = mooncake_error(code, "get k", partial=[b"x"])
    assert type(err) is cls
    assert (err.code, err.name, err.partial) == (code, name, (b"x",))
    assert f"{name} ({code})" in str(err)


def test_an_unreachable_master_and_a_full_store_are_both_store_unavailable() -> None:
    assert isinstance(mooncake_error(-900, ""), StoreUnavailable)
    assert isinstance(mooncake_error(-200, ""), StoreUnavailable)
    assert not isinstance(mooncake_error(-800, ""), StoreUnavailable)


def test_state_checkpoint_values_round_trip_and_reject_corruption() -> None:
    value = encode_state(b"conv" * 10, b"rec" * 100)
    assert decode_state(value) == (b"conv" * 10, b"rec" * 100)
    with pytest.raises(CorruptValueError):
        decode_state(value[:-1])
    with pytest.raises(CorruptValueError):
        decode_state(value[:-1] + bytes([value[-1] ^ 1]))
    with pytest.raises(CorruptValueError):
        decode_state(b"nope")
