"""``KvschedConnector``: kvsched's external store as a vLLM KV connector, hybrid states too.

    kv_transfer_config={"kv_connector": "KvschedConnector",
                        "kv_connector_module_path": "kvsched.integrations.vllm.store_connector",
                        "kv_role": "kv_both",      # kv_consumer: load only (a decode engine)
                        "kv_connector_extra_config": {"store": "dir:/path/to/store"}}

It runs under kvsched's scheduler only (``--scheduler-cls kvsched.integrations.vllm.Scheduler``):
kvsched's policy decides every lookup, load and save (``KVLookupStarted``, ``KVLoadStarted``,
``KVSaveStarted``: the event log records them and ``kvsched verify`` replays them), with
kvsched's key scheme (``connectors/keys.py``), so a hybrid model's save carries the state of
its checkpoint and a hit restores it. (Under kvsched, vLLM's own connectors serve attention
models only: kvsched hands them the attention group's blocks.)

The two halves, as vLLM splits a connector:

* scheduler side (``store_bridge.StoreBridge`` drives it): the orders of each step go to the
  worker in ``build_connector_meta`` (``StepOrders``: kvsched's ``LoadOrder`` / ``SaveOrder``
  with block ids, which are vLLM's, and each state slot's vLLM block per mamba group); the
  worker's reports come back in ``update_connector_output``.
* worker side: a ``TransferEngine`` (``connectors/transfer.py``) over vLLM's KV cache tensors
  (``VllmPages``). Loads start after the step's forward (the blocks belong to sequences that
  do not run until their load is reported), saves after it too (``wait_for_save``: they read
  what the forward wrote; kvsched's lease keeps the blocks). Reports go back as
  ``KVConnectorWorkerMetadata`` (``TransferReports``).

Options (``kv_connector_extra_config``): ``store`` (``dir:PATH``, a ``DirectoryStore``; or
``mooncake:HOST:PORT``, a Mooncake Store master), ``synchronous`` (the worker waits for its
transfers before the step's output: reports land at the next step, deterministically),
``lookup_timeout_s``, ``job_timeout_s`` (a transfer's deadline: past it, it is reported
failed and touches no block), ``wait_prefilled_s`` (how long a request whose
``kv_transfer_params`` say another engine prefilled it waits for the prefill's blocks),
``drill`` (a fault drill on the worker's store: ``connectors/drills.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvsched.connectors.protocol import StepTransfers, TransferReport
from kvsched.connectors.scheduler import StoreConnector
from kvsched.connectors.transfer import TransferEngine
from kvsched.integrations.vllm.store_options import (
    NAME,
    StoreOptions,
    StoreOptionsError,
    refuse_placement,
)

logger = logging.getLogger(__name__)

@dataclass
class StepOrders(KVConnectorMetadata):  # type: ignore[misc]
    """One step's transfers for the worker; ``states``: kvsched state slot -> the vLLM block
    holding it in each mamba group (for the slots the orders name)."""

    transfers: StepTransfers = field(default_factory=StepTransfers)
    states: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class TransferReports(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What the worker's transfers did since its last report."""

    reports: list[TransferReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TransferReports)
        return TransferReports(self.reports + other.reports)


class KvschedConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.options = StoreOptions.parse(dict(self._kv_transfer_config.kv_connector_extra_config))
        self._next = StepOrders()  # (scheduler) the orders for the next step's worker
        self._reports: list[TransferReport] = []  # (scheduler) from the worker
        self._lookups: StoreConnector | None = None  # (scheduler) its probes of the store
        self._engine: TransferEngine | None = None  # (worker)
        self._pages: VllmPages | None = None
        refuse_placement(vllm_config, scheduler_side=role == KVConnectorRole.SCHEDULER)

    # ------------------------------------------------------------------ scheduler side

    def lookups(self) -> StoreConnector:
        """The scheduler's probes of the store (opened once, closed at ``shutdown``): inline
        for a directory store (a few file checks), on a background thread for Mooncake."""
        if self._lookups is None:
            self._lookups = StoreConnector(
                self.options.open(),
                synchronous=self.options.local,
                lookup_timeout_s=self.options.lookup_timeout_s,
            )
        return self._lookups

    def order(self, transfers: StepTransfers, states: dict[int, tuple[int, ...]]) -> None:
        """Add transfers (and their state slots' blocks) to the next step's orders."""
        mine = self._next.transfers
        self._next.transfers = StepTransfers(
            mine.loads + transfers.loads, mine.saves + transfers.saves
        )
        self._next.states.update(states)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        out, self._next = self._next, StepOrders()
        return out

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, TransferReports):
            self._reports += meta.reports

    def take_reports(self) -> list[TransferReport]:
        out, self._reports = self._reports, []
        return out

    # (vLLM's scheduler-side entry points: kvsched's scheduler does not call them)
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._pages = VllmPages(kv_caches, self._kv_cache_config)
        self._engine = TransferEngine(
            self.options.open_worker(),
            self._pages,
            self._pages,
            job_timeout_s=self.options.job_timeout_s,
        )

    def _orders(self) -> StepOrders | None:
        if self._engine is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, StepOrders) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        orders = self._orders()
        if orders is not None and orders.transfers.loads:
            assert self._engine is not None and self._pages is not None
            self._pages.states.update(orders.states)
            self._engine.apply(StepTransfers(orders.transfers.loads, ()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        """After the forward: start the step's saves (they read what it wrote); with
        ``synchronous``, wait for every transfer (each ends by its own deadline)."""
        orders = self._orders()
        if orders is None:
            return
        assert self._engine is not None and self._pages is not None
        if orders.transfers.saves:
            self._pages.states.update(orders.states)
            self._engine.apply(StepTransfers((), orders.transfers.saves))
        if self.options.synchronous:
            self._engine.wait_idle(self.options.job_timeout_s + 1.0)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._engine is None:
            return None
        report = self._engine.poll()
        return None if report.is_empty else TransferReports([report])

    def shutdown(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
            self._lookups.store.close()
        if self._engine is not None:
            self._engine.close()
            self._engine.store.close()


class VllmPages:
    """vLLM's KV cache tensors block by block (``BlockBuffer``) and a hybrid model's states
    (``StateBuffer``): an attention block is its page in every full-attention layer; a state
    slot is, in each mamba group, the page of that group's layers in the vLLM block
    ``states[slot][g]`` (set from each step's orders). Bytes are copied as they are (any
    dtype, any layout whose block dimension has the cache's block count)."""

    def __init__(self, kv_caches: dict[str, Any], kv_cache_config: Any) -> None:
        n = int(kv_cache_config.num_blocks)
        self._attn: list[tuple[torch.Tensor, int]] = []
        self._mamba: list[list[tuple[torch.Tensor, int]]] = []
        for group in kv_cache_config.kv_cache_groups:
            views = [v for name in group.layer_names for v in _block_views(kv_caches[name], n)]
            if type(group.kv_cache_spec).__name__ == "MambaSpec":
                self._mamba.append(views)
            else:
                self._attn += views
        self.states: dict[int, tuple[int, ...]] = {}
        self._block_bytes = sum(_page_bytes(t, d) for t, d in self._attn)

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    def read_block(self, block_id: int) -> bytes:
        return b"".join(_read(t, d, block_id) for t, d in self._attn)

    def write_block(self, block_id: int, data: bytes) -> None:
        _write(self._attn, [block_id] * len(self._attn), data)

    def read_state(self, slot: int) -> tuple[bytes, bytes]:
        ids = self.states[slot]
        return b"", b"".join(
            _read(t, d, b) for views, b in zip(self._mamba, ids, strict=True) for t, d in views
        )

    def write_state(self, slot: int, conv: bytes, recurrent: bytes) -> None:
        ids = self.states[slot]
        views = [v for group in self._mamba for v in group]
        blocks = [b for group, b in zip(self._mamba, ids, strict=True) for _ in group]
        _write(views, blocks, conv + recurrent)


def _block_views(value: Any, num_blocks: int) -> list[tuple[torch.Tensor, int]]:
    """(tensor, its block dimension) for a layer's cache: one tensor, or a list of state
    tensors (a mamba layer's conv and recurrent states)."""
    tensors = list(value) if isinstance(value, list | tuple) else [value]
    out = []
    for t in tensors:
        dims = [i for i, size in enumerate(t.shape) if size == num_blocks]
        if not dims:
            raise StoreOptionsError(f"{NAME}: a KV cache tensor {tuple(t.shape)} has no block dim")
        out.append((t, dims[0]))
    return out


def _page_bytes(t: torch.Tensor, dim: int) -> int:
    return t.select(dim, 0).numel() * t.element_size()


def _read(t: torch.Tensor, dim: int, block: int) -> bytes:
    page = t.select(dim, block).contiguous()
    return page.view(torch.uint8).cpu().numpy().tobytes()  # (.cpu(): a no-op on CPU)


def _write(views: list[tuple[torch.Tensor, int]], blocks: list[int], data: bytes) -> None:
    sizes = [_page_bytes(t, d) for t, d in views]
    if sum(sizes) != len(data):
        raise ValueError(f"a value of {len(data)} bytes for pages of {sum(sizes)} bytes")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    at = 0
    for (t, d), block, size in zip(views, blocks, sizes, strict=True):
        page = t.select(d, block)
        page.copy_(raw[at : at + size].view(t.dtype).view(page.shape))
        at += size
