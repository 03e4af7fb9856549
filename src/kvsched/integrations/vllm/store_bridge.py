"""kvsched's own external-KV path inside vLLM (``KvschedConnector``): the adapter's side.

kvsched's policy decides every transfer, as in its own engine; this bridge carries each
decision out in vLLM:

    KVLookupStarted    -> a probe of the store (``StoreConnector``: inline for a directory,
                          on a thread for Mooncake), within the step's planning (the step's
                          lookup port, ``answer``); an answer known then is the decision's
                          ``answer`` (the request is admitted in that step), else it is
                          ``KVLookupAnswered`` at a later step
    KVLoadStarted      -> a ``LoadOrder`` for the worker (its state slot: the vLLM block of
                          each mamba group holding it, ``MambaLayout.phys``)
    KVSaveStarted      -> a ``SaveOrder`` likewise (the checkpoint's state with the blocks)
    the worker's report -> KVLoadFinished / KVLoadFailed (good leading blocks) /
                           KVSaveFinished, inputs of the next step

Disaggregation: a request finished by an engine that saves returns ``kv_transfer_params =
{"kvsched": {"prompt_blocks": n}}`` (the full prompt blocks it computed, whose saves may still
be running); a proxy passes them to the decode engine's request, whose lookup then waits
(re-probing each step, up to ``wait_prefilled_s``) until the store holds those blocks, so a
decode engine does not recompute a prefix because it asked before the prefill's saves
landed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request

from kvsched.connectors.protocol import (
    PENDING,
    LoadOrder,
    LookupRequest,
    SaveOrder,
    StepTransfers,
    report_events,
)
from kvsched.engine import LookupAnswer
from kvsched.events import types as ev
from kvsched.integrations.vllm.mamba import MambaLayout
from kvsched.integrations.vllm.store_connector import KvschedConnector

PARAMS_KEY = "kvsched"


class StoreBridge:
    """Owns the lookups asked and unanswered (with what a prefilled request waits for, and
    until when), the reports for the next step, the failed loads that end their request."""

    def __init__(
        self,
        connector: KvschedConnector,
        mamba: MambaLayout | None,
        block_size: int,
        fail_loads: bool = False,
        saves: bool = True,
    ) -> None:
        self.connector = connector
        self.options = connector.options
        self.lookups = connector.lookups()
        self.mamba = mamba
        self.bs = block_size
        self.fail_loads = fail_loads
        # seq -> (its probe, the blocks it waits for, until when)
        self._asked: dict[int, tuple[LookupRequest, int, float]] = {}
        self.saves = saves  # (whether this engine saves: its finished requests say so)
        self._reports: list[ev.Event] = []
        self._failed: list[tuple[int, str]] = []
        self.prefix_stats = PrefixCacheStats()

    # ------------------------------------------------------------------ per step

    def inputs(self, req_of: dict[int, Request]) -> list[ev.Event]:
        """The lookups answered since the last step (a prefilled request's only once the
        store holds all it asked for, or its wait is over) and the transfers that ended."""
        out, self._reports = self._reports, []
        now = time.monotonic()
        for seq_id in sorted(self._asked):
            blocks = self._poll(seq_id, now)
            if blocks is not None:
                out.append(ev.KVLookupAnswered(seq_id, blocks))
        return out

    def answer(self, e: ev.KVLookupStarted, req_of: dict[int, Request]) -> LookupAnswer | None:
        """The step's lookup port: the store probed within the step's planning (None: no
        answer yet, a Mooncake probe on its thread or a prefilled request still waiting;
        polled again at each step's ``inputs``). Its loads are asynchronous (the worker's
        transfer engine reports them)."""
        self._asked[e.seq_id] = (LookupRequest.from_event(e), *self._wait_for(e, req_of))
        blocks = self._poll(e.seq_id, time.monotonic())
        return None if blocks is None else LookupAnswer(blocks)

    def _poll(self, seq_id: int, now: float) -> int | None:
        """The answer to an outstanding lookup if it is known and final (then it is no
        longer outstanding), else None."""
        request, wanted, until = self._asked[seq_id]
        answer = self.lookups.lookup(request)
        if answer is PENDING:
            return None
        self.lookups.cancel_lookup(seq_id)  # (consumed: a later lookup probes again)
        if answer.num_blocks < wanted and now < until:
            return None  # (probed again next step)
        del self._asked[seq_id]
        return answer.num_blocks

    def after_step(
        self, decisions: Iterable[ev.Event], req_of: dict[int, Request], blocks_of: Any
    ) -> None:
        loads: list[LoadOrder] = []
        saves: list[SaveOrder] = []
        slots: set[int] = set()
        for d in decisions:
            if isinstance(d, ev.KVLookupStarted):
                if d.answer < 0 and d.seq_id not in self._asked:  # (no port asked it)
                    request = LookupRequest.from_event(d)
                    self._asked[d.seq_id] = (request, *self._wait_for(d, req_of))
                    self.lookups.lookup(request)
            elif isinstance(d, ev.KVLoadCancelled | ev.KVLoadStarted):
                self._asked.pop(d.seq_id, None)
                self.lookups.cancel_lookup(d.seq_id)
                if isinstance(d, ev.KVLoadStarted):
                    loads.append(LoadOrder.from_event(d))
                    slots.add(d.state_slot)
            elif isinstance(d, ev.KVSaveStarted):
                saves.append(SaveOrder.from_event(d))
                slots.add(d.state_slot)
        if loads or saves:
            self.connector.order(StepTransfers(tuple(loads), tuple(saves)), self._states(slots))

    def _states(self, slots: set[int]) -> dict[int, tuple[int, ...]]:
        """Each state slot's vLLM block per mamba group, as the step's lists name them."""
        if self.mamba is None:
            return {}
        return {s: self.mamba.blocks_of(s) for s in sorted(slots) if s > 0}

    def _wait_for(
        self, asked: ev.KVLookupStarted, req_of: dict[int, Request]
    ) -> tuple[int, float]:
        """(the blocks a lookup waits for, until when): a request another engine prefilled
        waits for the prompt blocks it computed (no more than asked), others for nothing."""
        params = getattr(req_of[asked.seq_id], "kv_transfer_params", None) or {}
        mine = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        if not isinstance(mine, dict) or not isinstance(mine.get("prompt_blocks"), int):
            return 0, 0.0
        wanted = min(asked.num_blocks, mine["prompt_blocks"])
        return wanted, time.monotonic() + self.options.wait_prefilled_s

    def meta(self, out: Any, blocks_of_name: Callable[[str], Any]) -> None:
        out.kv_connector_metadata = self.connector.build_connector_meta(out)

    def landed(self, output: Any) -> None:
        """A step's worker report: the transfers that ended, inputs of the next step."""
        if output is None:
            return
        self.connector.update_connector_output(output)
        for report in self.connector.take_reports():
            events = report_events(report)
            self._reports += events
            if self.fail_loads:
                self._failed += [
                    (e.seq_id, f"KV load failed ({e.reason})")
                    for e in events
                    if isinstance(e, ev.KVLoadFailed)
                ]

    def take_failed(self) -> list[tuple[int, str]]:
        failed, self._failed = self._failed, []
        return failed

    def finished(self, request: Request, seq_id: int, block_ids: list[int]) -> Any:
        """A request ended: for a decode engine, the full prompt blocks this engine computed
        and saves (an attention model's every full block; a hybrid model's up to each aligned
        checkpoint, with its state: a decode engine then waits until its wait is over for
        blocks past the last one, and loads what is there)."""
        if not self.saves:
            return None
        computed = min(request.num_computed_tokens, request.num_prompt_tokens)
        return {PARAMS_KEY: {"prompt_blocks": computed // self.bs}}

    def take_stats(self) -> tuple[PrefixCacheStats, dict[str, Any] | None]:
        prefix, self.prefix_stats = self.prefix_stats, PrefixCacheStats()
        return prefix, None

    def events(self) -> list[Any]:
        return []
