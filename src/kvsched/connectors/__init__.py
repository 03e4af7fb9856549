"""External KV: the connector protocol, key scheme, stores and the worker transfer engine.

See ``README.md`` beside this file and ``docs/connectors.md``. ``MooncakeStore`` is imported
from ``kvsched.connectors.mooncake_store`` (optional dependency ``kvsched[mooncake]``).
"""

from kvsched.connectors.buffers import HostBlockBuffer, HostStateBuffer, decode_state, encode_state
from kvsched.connectors.errors import (
    CorruptValueError,
    InvalidRequest,
    LeaseHeld,
    NoSpace,
    RpcFailed,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    TransferFailed,
    mooncake_error,
)
from kvsched.connectors.keys import block_key, namespace_prefix, parse_key, state_key
from kvsched.connectors.memory_store import Faults, InProcessStore
from kvsched.connectors.protocol import (
    PENDING,
    BlockBuffer,
    KVStore,
    LoadOrder,
    LookupAnswer,
    LookupRequest,
    LookupResult,
    SaveOrder,
    SchedulerConnector,
    StateBuffer,
    StepTransfers,
    TransferReport,
    WorkerConnector,
    report_events,
)
from kvsched.connectors.scheduler import StoreConnector, count_available
from kvsched.connectors.transfer import TransferEngine

__all__ = [
    "PENDING",
    "BlockBuffer",
    "CorruptValueError",
    "Faults",
    "HostBlockBuffer",
    "HostStateBuffer",
    "InProcessStore",
    "InvalidRequest",
    "KVStore",
    "LeaseHeld",
    "LoadOrder",
    "LookupAnswer",
    "LookupRequest",
    "LookupResult",
    "NoSpace",
    "RpcFailed",
    "SaveOrder",
    "SchedulerConnector",
    "StateBuffer",
    "StepTransfers",
    "StoreConnector",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "TransferEngine",
    "TransferFailed",
    "TransferReport",
    "WorkerConnector",
    "block_key",
    "count_available",
    "decode_state",
    "encode_state",
    "mooncake_error",
    "namespace_prefix",
    "parse_key",
    "report_events",
    "state_key",
]
