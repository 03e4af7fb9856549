"""Typed store errors. Mooncake's integer return codes map onto this hierarchy.

``StoreError``
    ``StoreUnavailable``   the store cannot be reached or did not answer in time
        ``StoreTimeout``   a call passed its deadline (the blocking call may still be running)
        ``RpcFailed``      Mooncake -900 / -901 (master unreachable, RPC timeout)
        ``NoSpace``        Mooncake -200 (no segment to place a value; holder gone)
    ``TransferFailed``     Mooncake -800 / -801 (the memory holder of a value died mid-read)
    ``InvalidRequest``     Mooncake -600 (empty value, buffer too small, value too large)
    ``LeaseHeld``          Mooncake -706 (remove right after a put/get)

A missing key is not an error: ``get_many`` returns ``None`` for it.

``partial`` on a read error holds the values of the leading keys that were read before the
failure, so a load can keep its good leading blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "MOONCAKE_CODES",
    "CorruptValueError",
    "InvalidRequest",
    "LeaseHeld",
    "NoSpace",
    "RpcFailed",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "TransferFailed",
    "mooncake_error",
]

# Mooncake's ErrorCode (types.h, 0.3.x): the values the Python binding returns as ints.
MOONCAKE_CODES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -710: "REPLICA_NOT_FOUND",
    -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}


class StoreError(Exception):
    """A store call failed. ``code`` is the backend's code (None if it has none)."""

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        name: str = "",
        partial: Sequence[bytes] = (),
    ) -> None:
        self.code = code
        self.name = name or type(self).__name__
        self.partial: tuple[bytes, ...] = tuple(partial)
        prefix = f"{self.name} ({code}): " if code is not None else f"{self.name}: "
        super().__init__(prefix + message)


class StoreUnavailable(StoreError):
    """The store cannot be reached or does not answer."""


class StoreTimeout(StoreUnavailable):
    """A call passed its deadline."""


class RpcFailed(StoreUnavailable):
    """Mooncake's master did not answer (RPC_FAIL, RPC_TIMEOUT)."""


class NoSpace(StoreUnavailable):
    """No segment can take the value (NO_AVAILABLE_HANDLE): no memory holder is mounted."""


class TransferFailed(StoreError):
    """The data transfer of a present object failed (its memory holder died)."""


class InvalidRequest(StoreError):
    """The backend rejected the call's parameters."""


class LeaseHeld(StoreError):
    """The object is leased (recently read or written) and cannot be removed yet."""


class CorruptValueError(ValueError):
    """A stored value does not decode (wrong size, bad magic, checksum mismatch)."""


_BY_CODE: dict[int, type[StoreError]] = {
    -200: NoSpace,
    -600: InvalidRequest,
    -706: LeaseHeld,
    -800: TransferFailed,
    -801: TransferFailed,
    -900: RpcFailed,
    -901: RpcFailed,
}


def mooncake_error(code: int, what: str, partial: Sequence[bytes] = ()) -> StoreError:
    """The typed error for a negative Mooncake return code."""
    cls = _BY_CODE.get(code, StoreError)
    name = MOONCAKE_CODES.get(code, "UNKNOWN")
    return cls(what, code=code, name=name, partial=partial)
