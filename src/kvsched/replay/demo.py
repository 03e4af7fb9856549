"""``kvsched demo``: the built-in multi-turn chat workload on one engine, or, with
``external=True``, an A/B run through one in-process KV store (engine B, a restarted server
with an empty cache, loads what engine A saved)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import attrs

from kvsched.config import (
    DEMO_MAX_BATCH,
    DEMO_NUM_BLOCKS,
    ExternalStore,
    ModelSpec,
    SchedulerConfig,
    Speculation,
)
from kvsched.connectors import InProcessStore, StoreConnector, TransferEngine
from kvsched.connectors.buffers import HostBlockBuffer, HostStateBuffer
from kvsched.engine import Engine
from kvsched.events.log import EventLog
from kvsched.events.wire import Publisher
from kvsched.gpu.sim import CostModel, SimulatedExecutor
from kvsched.replay.driver import Executor
from kvsched.replay.external import ExternalKV
from kvsched.replay.metrics import ReplayResult
from kvsched.replay.runs import Progress, no_progress, replay
from kvsched.replay.setup import SetupError, make_executor, open_log, torch_module
from kvsched.replay.workload import Workload, chat_workload
from kvsched.stream.publish import open_publisher


@attrs.frozen
class DemoRun:
    """The reported run (engine B's with ``external``) and what the demo adds to its
    metrics: the workload's name and, with ``external``, ``external_hit_tokens``,
    ``engine_a_prefill_tokens`` and ``store_values``."""

    result: ReplayResult
    workload: Workload
    extra: dict[str, Any]

    @property
    def metrics(self) -> dict[str, Any]:
        return {**self.result.metrics, **self.extra}


def external_bridge(
    store: InProcessStore, config: SchedulerConfig, executor: Executor
) -> ExternalKV:
    """The bridge to ``store``: the torch executor's cache as buffers, host buffers for the
    simulated executor (whose KV has no contents)."""
    blocks: Any
    states: Any
    if isinstance(executor, SimulatedExecutor):
        blocks = HostBlockBuffer(config.num_blocks, 64)
        states = HostStateBuffer(config.num_state_slots, 8, 8)
    else:
        from kvsched.gpu.transfer_buffer import TorchCacheBuffer

        blocks = states = TorchCacheBuffer(executor)  # type: ignore[arg-type]
    worker = TransferEngine(store, blocks, states if config.hybrid else None)
    return ExternalKV(StoreConnector(store, synchronous=True), worker)


def demo_model(model: str | None, workdir: str, seed: int = 0) -> tuple[str, int]:
    """The checkpoint for the torch executor: ``model`` (a directory), else a seeded tiny
    Qwen3.5-style model written to ``workdir``. Returns (directory, vocabulary size)."""
    if model:
        config_path = os.path.join(model, "config.json")
        try:
            with open(config_path) as f:
                return model, int(json.load(f)["vocab_size"])
        except (OSError, KeyError, ValueError) as exc:
            raise SetupError(f"--model {model}: cannot read {config_path}: {exc}") from None
    try:
        from kvsched.gpu.fixtures import build_tiny_model
    except ImportError as exc:
        raise SetupError(f"--executor torch needs the torch extra: {exc}") from None
    path, model_config = build_tiny_model(os.path.join(workdir, "tiny-qwen3.5"), seed=seed)
    return str(path), int(model_config.vocab_size)


@attrs.frozen
class _Server:
    """How the demo serves its workload on an engine."""

    config: SchedulerConfig
    workload: Workload
    executor: str
    model_dir: str | None
    progress: Progress

    def serve(self, engine: Engine, desc: str, store: InProcessStore | None = None) -> ReplayResult:
        executor = make_executor(self.executor, self.config, CostModel(), self.model_dir)
        external = external_bridge(store, self.config, executor) if store is not None else None
        return replay(
            engine, executor, self.workload, desc=desc, progress=self.progress, external=external
        )


def run_demo(
    *,
    sessions: int = 64,
    turns: int = 4,
    seed: int = 0,
    cache_blocks: int = DEMO_NUM_BLOCKS,
    max_batch: int = DEMO_MAX_BATCH,
    executor: str = "sim",
    model: str | None = None,
    hybrid: bool = False,
    external: bool = False,
    pipelined: bool = False,
    check: bool = False,
    log: str | None = None,
    publish: str | None = None,
    wait_subscribers: int = 0,
    progress: Progress = no_progress,
) -> DemoRun:
    """Serve ``sessions`` chat sessions of ``turns`` turns; record the reported run to the
    event log ``log`` if given, and publish its stream on the ZeroMQ endpoint ``publish``
    (after ``wait_subscribers`` subscribers connected). The log and the publisher are opened
    before any work, so a bad path or endpoint costs nothing (``LogOpenError``,
    ``WireError``); a bad executor or model is a SetupError."""
    with tempfile.TemporaryDirectory(prefix="kvsched-demo-") as workdir:
        vocab, model_dir = ModelSpec().vocab_size, None
        if executor == "torch":
            torch_module()  # fail before any work when torch is missing
            model_dir, vocab = demo_model(model, workdir, seed)
        config = SchedulerConfig(
            model=ModelSpec(vocab_size=vocab),
            num_blocks=cache_blocks,
            max_batch=max_batch,
            hybrid=hybrid or executor == "torch",  # the torch model is hybrid
            external=ExternalStore(enabled=external),
            speculation=Speculation(pipelined=pipelined),
        )
        event_log = open_log(log, config)
        sinks: list[Publisher] = []
        try:
            if publish:
                sinks.append(open_publisher(publish, config, wait_subscribers))
            workload = chat_workload(sessions=sessions, turns=turns, seed=seed, vocab_size=vocab)
            server = _Server(config, workload, executor, model_dir, progress)
            if external:
                return _serve_twice(server, event_log, sinks, check)
            engine = Engine(config, log=event_log, sinks=sinks, check_invariants=check)
            result = server.serve(engine, "demo")
        finally:
            if event_log is not None:
                event_log.close()
            for sink in sinks:
                sink.close()
    return DemoRun(result, workload, {"workload": workload.name})


def _serve_twice(
    server: _Server, log: EventLog | None, sinks: list[Publisher], check: bool
) -> DemoRun:
    """Serve the workload on engine A, saving to an in-process store; then on engine B (a
    restarted server: empty cache, same store), which loads A's prefixes. B's run is the one
    logged and reported."""
    store = InProcessStore(capacity_bytes=8 << 30)
    res_a = server.serve(Engine(server.config, check_invariants=check), "demo A", store)
    engine = Engine(server.config, log=log, sinks=sinks, check_invariants=check)
    result = server.serve(engine, "demo B", store)
    extra = {
        "workload": server.workload.name,
        "external_hit_tokens": engine.state.stats.external_hit_tokens,
        "engine_a_prefill_tokens": res_a.metrics.get("prefill_tokens", 0),
        "store_values": len(store),
    }
    return DemoRun(result, server.workload, extra)
