"""vLLM's KV connectors under kvsched: the connector's scheduler side, called where vLLM's
own scheduler calls it, on kvsched's external-KV machine (``KVLoad``).

    kvsched decision / input             vLLM connector call (scheduler side)
    KVLookupStarted(seq, first, end)  -> get_num_new_matched_tokens(request, first * block),
                                         within the step's planning (the step's lookup
                                         port, ``answer``): the answer, first + matched
                                         tokens // block, is the decision's ``answer``, so
                                         the request is admitted in that step, as vLLM's is
    KVLookupAnswered(seq, blocks)     <- the same, for a lookup the connector could not
                                         answer yet (None: asked again each step, as vLLM
                                         does)
    KVLoadStarted (an async load)     -> update_state_after_alloc(request, blocks, tokens)
    KVLoadFinished / KVLoadFailed     <- kv_connector_output: finished_recving, failed_recving,
                                         invalid_block_ids (the good leading blocks)
    KVLoadStarted (a sync load)       -> KVLoadFinished at the next step: the worker loads
                                         it in the forward of the step that runs the sequence
    KVLoadSettled (a sync load)       -> update_state_after_alloc in that step,
                                         has_sync_kv_loads (its loads precede the forward)
    each step                         -> build_connector_meta, kv_connector_block_state
    a request finished or aborted     -> request_finished (its kv_transfer_params go out);
                                         a delayed free: KVHoldRequested (a lease on the
                                         blocks it was given) until finished_sending:
                                         KVHoldReleased

The connector decides and runs its own saves (``ExternalStore.saver = "connector"``): kvsched
orders none, and holds what the connector still reads after a request ends. A synchronous
load whose blocks the worker reports bad (the step already read them) is a clear error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import KVConnectorBlockState
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from kvsched.engine import LookupAnswer
from kvsched.events import types as ev
from kvsched.integrations.vllm.config import fails_loads, has_connector, is_kvsched_connector
from kvsched.integrations.vllm.mamba import MambaLayout
from kvsched.integrations.vllm.store_bridge import StoreBridge

BlocksOf = Callable[[int], list[int]]  # a sequence's block ids, as kvsched holds them


class ConnectorError(RuntimeError):
    """What the adapter cannot do with this connector (a clear error, never a wrong token)."""


def create(
    vllm_config: Any, kv_cache_config: Any, block_size: int, mamba: MambaLayout | None = None
) -> ConnectorBridge | StoreBridge | None:
    """The bridge to the scheduler side of the KV connector vLLM is configured with (None:
    none), made by vLLM's factory as vLLM's scheduler makes it: kvsched's own
    (``KvschedConnector``: ``StoreBridge``, kvsched decides its saves too) or any other."""
    if not has_connector(vllm_config):
        return None
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    made = KVConnectorFactory.create_connector(
        config=vllm_config, role=KVConnectorRole.SCHEDULER, kv_cache_config=kv_cache_config
    )
    if is_kvsched_connector(vllm_config):
        saves = vllm_config.kv_transfer_config.kv_role != "kv_consumer"
        return StoreBridge(made, mamba, block_size, fails_loads(vllm_config), saves)
    return ConnectorBridge(made, block_size, fails_loads(vllm_config))


class ConnectorBridge:
    """Owns the connector's lookups and loads in flight, by sequence: lookups asked and not
    answered, the answers and load reports for the next step, the synchronous loads the
    worker carries out when their sequence first runs, the asynchronous ones by name."""

    def __init__(self, connector: Any, block_size: int, fail_loads: bool = False) -> None:
        self.connector = connector
        self.bs = block_size
        # vLLM's kv_load_failure_policy "fail": a failed load ends its request in error
        # (else, "recompute", the request recomputes past its good blocks)
        self.fail_loads = fail_loads
        self._failed: list[tuple[int, str]] = []  # (seq, reason): requests to end in error
        self._asked: dict[int, int] = {}  # seq -> first block of its lookup, unanswered
        self._async: dict[int, bool] = {}  # seq -> whether its answered hit loads async
        self._sync: dict[int, int] = {}  # seq -> tokens its first step loads (sync loads)
        self._loading: dict[str, tuple[int, list[int]]] = {}  # name -> (seq, load blocks)
        self._held: dict[str, int] = {}  # name -> seq: blocks kept for a connector transfer
        self._good: dict[str, int] = {}  # name -> good leading blocks of a load reported bad
        self._reports: list[ev.Event] = []  # for the next step
        self._sync_now = False
        # statistics since vLLM last asked (make_stats): prompt tokens asked of the
        # connector and those it served; the transfer statistics the worker reported
        self.prefix_stats = PrefixCacheStats()
        self._transfer_stats: Any = None

    # ------------------------------------------------------------------ per step

    def inputs(self, req_of: dict[int, Request]) -> list[ev.Event]:
        """The next step's inputs: the answers to lookups (a pending one asked again) and
        the loads that ended."""
        out, self._reports = self._reports, []
        for seq_id in sorted(self._asked):
            out += self._answered(seq_id, req_of[seq_id])
        return out

    def answer(self, e: ev.KVLookupStarted, req_of: dict[int, Request]) -> LookupAnswer | None:
        """The step's lookup port: the connector asked within the step's planning, as
        vLLM's scheduler asks it (None: it cannot answer yet; asked again next step)."""
        self._asked[e.seq_id] = e.first_block
        blocks = self._ask(e.seq_id, req_of[e.seq_id])
        return None if blocks is None else LookupAnswer(blocks, self._is_sync(e.seq_id))

    def after_step(
        self, decisions: Iterable[ev.Event], req_of: dict[int, Request], blocks_of: BlocksOf
    ) -> None:
        """Carry a step's external-KV decisions to the connector (after its plan)."""
        self._sync_now = False
        for d in decisions:
            if isinstance(d, ev.KVLookupStarted):
                if d.answer < 0 and d.seq_id not in self._asked:  # (no port asked it)
                    self._asked[d.seq_id] = d.first_block
                    self._reports += self._answered(d.seq_id, req_of[d.seq_id])
            elif isinstance(d, ev.KVLoadCancelled):
                self._asked.pop(d.seq_id, None)
                self._async.pop(d.seq_id, None)
            elif isinstance(d, ev.KVLoadStarted):
                self._start(d, req_of[d.seq_id], blocks_of)
            elif isinstance(d, ev.KVLoadSettled) and d.seq_id in self._sync:
                tokens = self._sync.pop(d.seq_id)
                request, blocks = req_of[d.seq_id], blocks_of(d.seq_id)
                self.connector.update_state_after_alloc(request, _blocks(blocks), tokens)
                self._sync_now = True
            elif isinstance(d, ev.SequencePreempted | ev.SequenceAborted):
                self._forget(d.seq_id)
            elif isinstance(d, ev.SequenceFinished):
                for seq_id in d.seq_ids.tolist():
                    self._forget(seq_id)

    def meta(self, out: Any, blocks_of_name: Callable[[str], tuple[list[int], ...]]) -> None:
        """The step's connector metadata, built last (``build_connector_meta``), with the
        block state a saving connector reads for the requests the step schedules."""
        out.has_sync_kv_loads = self._sync_now
        out.kv_connector_block_state = KVConnectorBlockState(
            req_ids=set(out.num_scheduled_tokens),
            resolve_block_ids=blocks_of_name,
            boundary_state_offloads={},
        )
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        out.kv_connector_block_state = None

    def landed(self, output: Any) -> None:
        """A step's worker report (``KVConnectorOutput``): the asynchronous loads that
        finished, failed whole (``failed_recving``) or wrote bad blocks (the good leading
        ones are kept). A bad block outside them was read by the step: a clear error."""
        if output is None:
            return
        self.connector.update_connector_output(output)
        self._add_stats(output.kv_connector_stats)
        bad = set(output.invalid_block_ids or ())
        failed = set(getattr(output, "failed_recving", None) or ())
        for name, (_, blocks) in self._loading.items() if bad or failed else ():
            good = next((i for i, b in enumerate(blocks) if b in bad), len(blocks))
            good = 0 if name in failed else good
            if good < len(blocks):
                self._good[name] = min(self._good.get(name, good), good)
            bad.difference_update(blocks)
        if bad:
            raise ConnectorError(
                f"connector {type(self.connector).__name__} reports KV blocks {sorted(bad)} "
                "bad after a step read them (a synchronous load): the kvsched adapter "
                "cannot recompute them"
            )
        for name in sorted(output.finished_sending or ()):
            if name in self._held:
                self._reports.append(ev.KVHoldReleased(self._held.pop(name)))
        for name in sorted(set(output.finished_recving or ()) | failed):
            if name not in self._loading:
                continue
            seq_id, blocks = self._loading.pop(name)
            good = self._good.pop(name, len(blocks))
            if good < len(blocks):
                why = f"connector {type(self.connector).__name__}: load block {good} failed"
                self._reports.append(ev.KVLoadFailed(seq_id, good, why))
                if self.fail_loads:
                    self._failed.append((seq_id, f"KV load failed ({why})"))
            else:
                self._reports.append(ev.KVLoadFinished(seq_id))

    def take_failed(self) -> list[tuple[int, str]]:
        """(sequence, reason) of the requests a failed load ends in error (policy "fail")
        since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def finished(self, request: Request, seq_id: int, block_ids: list[int]) -> Any:
        """A request finished or aborted: the connector's ``request_finished`` (its
        ``kv_transfer_params`` for the request's output). A delayed free keeps the blocks
        the connector was given (a hold, input of the next step: before the sequence's end
        frees them) until the worker reports the transfer done (``finished_sending``)."""
        delay, params = self.connector.request_finished(request, block_ids)
        if delay and block_ids:
            self._held[request.request_id] = seq_id
            self._reports.append(ev.KVHoldRequested(seq_id, len(block_ids)))
        return params

    def take_stats(self) -> tuple[PrefixCacheStats, dict[str, Any] | None]:
        """The statistics since the last call (``SchedulerStats``' connector fields)."""
        self._add_stats(self.connector.get_kv_connector_stats())
        prefix, self.prefix_stats = self.prefix_stats, PrefixCacheStats()
        stats, self._transfer_stats = self._transfer_stats, None
        return prefix, (stats.to_dict() if stats is not None and not stats.is_empty() else None)

    def _add_stats(self, stats: Any) -> None:
        if stats is not None:
            mine = self._transfer_stats
            self._transfer_stats = stats if mine is None else mine.aggregate(stats)

    def events(self) -> list[Any]:
        return list(self.connector.take_events() or ())

    # ------------------------------------------------------------------ helpers

    def _ask(self, seq_id: int, request: Request) -> int | None:
        """Ask the connector about an outstanding lookup: the chain blocks it can serve
        (then the lookup is no longer outstanding), or None (asked again at the next step)."""
        first = self._asked[seq_id]
        tokens, load_async = self.connector.get_num_new_matched_tokens(request, first * self.bs)
        if tokens is None:
            return None
        del self._asked[seq_id]
        blocks = max(0, int(tokens)) // self.bs
        if blocks:
            self._async[seq_id] = bool(load_async)
        return first + blocks

    def _answered(self, seq_id: int, request: Request) -> list[ev.Event]:
        blocks = self._ask(seq_id, request)
        if blocks is None:
            return []
        return [ev.KVLookupAnswered(seq_id, blocks, sync_load=self._is_sync(seq_id))]

    def _is_sync(self, seq_id: int) -> bool:
        """Whether the hit just answered loads synchronously (in the forward of the step
        that first runs the sequence: kvsched's ``KVLoadStarted.synchronous``)."""
        return self._async.get(seq_id) is False

    def _forget(self, seq_id: int) -> None:
        """A sequence left, or went back to waiting: no load of it is owed to the worker."""
        self._sync.pop(seq_id, None)
        self._async.pop(seq_id, None)

    def _start(self, d: ev.KVLoadStarted, request: Request, blocks_of: BlocksOf) -> None:
        tokens = len(d.blocks) * self.bs
        if not self._async.pop(d.seq_id, False):
            self._sync[d.seq_id] = tokens  # (the worker loads it when the sequence first runs)
            if not d.synchronous:  # (ended when started, else it ends at the next step)
                self._reports.append(ev.KVLoadFinished(d.seq_id))
            return
        self.connector.update_state_after_alloc(request, _blocks(blocks_of(d.seq_id)), tokens)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._loading[request.request_id] = (d.seq_id, d.blocks.tolist())


def _blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))


Bridge = ConnectorBridge | StoreBridge  # (the adapter's side of a KV connector)
