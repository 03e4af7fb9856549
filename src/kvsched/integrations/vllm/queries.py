"""The queries of ``Scheduler`` (vLLM's ``SchedulerInterface``: request counts, cache usage,
the names a KV-events subscriber holds), mixed into it: none writes, except ``make_stats``,
which hands vLLM the prefix-cache counts gathered since its last call."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

from kvsched.config import SchedulerConfig
from kvsched.engine import Engine
from kvsched.integrations.vllm.connector import Bridge
from kvsched.integrations.vllm.grammar import Grammars
from kvsched.integrations.vllm.kv_events import KVEventTranslator
from kvsched.integrations.vllm.outputs import scheduler_stats
from kvsched.integrations.vllm.requests import Registry


class Queries:
    # (the Scheduler's own state, which these read)
    engine: Engine
    config: SchedulerConfig
    grammars: Grammars
    requests: dict[str, Any]
    log_stats: bool
    _pause: PauseState
    _finished_ids: set[str]
    _inputs: list[Any]
    _errors: list[Any]
    _expected: dict[int, str]
    _prefix_stats: PrefixCacheStats
    _kv_events: KVEventTranslator
    reg: Registry
    connector: Any
    kv: Bridge | None
    kv_event_publisher: Any

    def get_num_unfinished_requests(self) -> int:
        """vLLM's count: none under PAUSED_ALL; under PAUSED_NEW only what runs (the queued
        requests stay queued, so a pause that waits for a drain ends)."""
        if self._pause == PauseState.PAUSED_ALL:
            return 0
        if self._pause == PauseState.PAUSED_NEW:
            return int(self.engine.state.seqs.num_running)
        return len(self.requests)

    def has_finished_requests(self) -> bool:
        # Folds still owed to kvsched (an outcome, aborts) count: the engine keeps stepping
        # until kvsched has retired what vLLM already finished, while kvsched's loads or
        # saves are in flight (the last request's saves land; their leases are freed), and
        # while a connector still sends a finished request's blocks (as vLLM's scheduler
        # keeps such a request: the worker reports the send in a later step's output).
        owed = self._finished_ids or self._inputs or self._errors or self._expected
        saving = self.kv is not None and any(self.engine.transfers_in_flight())
        return bool(owed) or saving or bool(self.engine.connector_holds())

    def get_request_counts(self) -> tuple[int, int]:
        t = self.engine.state.seqs  # (waiting: also those whose grammar compiles, as vLLM's)
        return t.num_running, len(t.waiting) + len(self.grammars.waiting)

    def get_kv_cache_usage(self) -> float:
        pool = self.engine.state.pool
        return 1.0 - pool.num_available / max(1, self.config.num_blocks - 1)

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        running, waiting = self.get_request_counts()
        stats, self._prefix_stats = self._prefix_stats, PrefixCacheStats()
        usage = self.get_kv_cache_usage()
        connector = self.kv.take_stats() if self.kv is not None else (None, None)
        return scheduler_stats(running, waiting, usage, stats, connector)

    def cached_names(self) -> dict[str, list[str]]:
        """The vLLM event names of kvsched's cached blocks and published checkpoints
        (``KVEventTranslator.cache_names``): what a KV-events subscriber must hold."""
        return self._kv_events.cache_names(self.engine.state)

    def _computed(self, request: Any) -> list[int]:  # (the blocks of its computed tokens)
        n = -(-request.num_computed_tokens // self.config.block_size)
        return self._blocks_of(self.reg.seq_of[request.request_id])[:n]

    def _blocks_of(self, seq_id: int) -> list[int]:
        state = self.engine.state
        return state.seqs.block_table(state.seq(seq_id)).tolist()  # type: ignore[no-any-return]

    @property
    def pause_state(self) -> PauseState:
        return self._pause

    def get_kv_event_publisher_config(self) -> Any:
        return self.kv_event_publisher.get_publisher_config()

    def get_kv_connector(self) -> Any:
        return self.connector
