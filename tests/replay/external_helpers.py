"""A node for external-KV tests: one engine, one executor, a transfer engine over a shared
store, and the ExternalKV bridge, stepped by hand so a test can act between steps."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np
from tests.policy import helpers as policy_helpers

from kvsched.config import SchedulerConfig
from kvsched.connectors import StoreConnector, TransferEngine
from kvsched.connectors.protocol import KVStore
from kvsched.engine import Engine, StepResult, create_log
from kvsched.events import types as ev
from kvsched.gpu.fingerprint import FingerprintExecutor
from kvsched.replay.external import ExternalKV

VOCAB = policy_helpers.VOCAB


def config(**overrides: object) -> SchedulerConfig:
    """The policy tests' small config (16-token blocks, 64 blocks, 8 rows, 64-token prefill
    budget) with 8 checkpoint slots for a hybrid model."""
    slots = {"checkpoint_budget": 8} if overrides.get("hybrid") else {}
    return policy_helpers.config(**{**slots, **overrides})


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, VOCAB, n, dtype=np.int32)


class Node:
    """``executor`` must be a BlockBuffer (and StateBuffer for hybrid models) as well as an
    executor (FingerprintExecutor by default); pass ``buffers`` when it is not."""

    def __init__(
        self,
        store: KVStore | None,
        cfg: SchedulerConfig,
        *,
        executor: Any = None,
        buffers: Any = None,
        synchronous: bool = True,
        async_lookups: bool = False,
        lookup_timeout_s: float = 5.0,
        job_timeout_s: float = 10.0,
        log_path: str | None = None,
    ) -> None:
        self.config = cfg
        log = create_log(log_path, cfg) if log_path is not None else None
        self.engine = Engine(cfg, log=log, check_invariants=True)
        self.executor = executor or FingerprintExecutor(
            cfg.model.vocab_size, cfg.num_blocks, cfg.block_size, cfg.num_state_slots
        )
        buf = buffers if buffers is not None else self.executor
        self.worker: TransferEngine | None = None
        self.external: ExternalKV | None = None
        if store is not None and cfg.external.enabled:
            self.worker = TransferEngine(
                store, buf, buf if cfg.hybrid else None, job_timeout_s=job_timeout_s
            )
            connector = StoreConnector(
                store, synchronous=not async_lookups, lookup_timeout_s=lookup_timeout_s
            )
            self.external = ExternalKV(connector, self.worker, synchronous=synchronous)
        self.outputs: dict[int, list[int]] = defaultdict(list)
        self.pending: list[ev.Event] = []
        self.decisions: list[ev.Event] = []
        self.inputs: list[ev.Event] = []
        self.prefill_tokens = 0
        self.clock = 0.0

    @property
    def busy(self) -> bool:
        ext = self.external is not None and self.external.busy
        return self.engine.has_work or bool(self.pending) or ext

    def step(self, inputs: Iterable[ev.Event] = ()) -> StepResult:
        arrived = self.external.inputs() if self.external is not None else []
        batch = [*self.pending, *inputs, *arrived]
        result = self.engine.step(batch, self.clock)
        self.clock += 0.001
        self.inputs.extend(batch)
        self.decisions.extend(result.decisions)
        self.pending = []
        if not result.plan.is_empty:
            self.prefill_tokens += result.plan.num_prefill_tokens
            out = self.executor.execute(result.plan)
            for seq, tok in zip(out.seq_ids.tolist(), out.tokens.tolist(), strict=True):
                self.outputs[seq].append(tok)
            self.pending.append(out)
        if self.external is not None:
            self.external.after_step(result.decisions)
        return result

    def run(self, inputs: Iterable[ev.Event] = (), max_steps: int = 2000) -> None:
        self.step(inputs)
        for _ in range(max_steps):
            if not self.busy:
                return
            if self.external is not None and not self.pending:
                self.external.wait()
            self.step()
        raise AssertionError("the node did not become idle")

    def of_type(self, kind: type) -> list[Any]:
        return [d for d in self.decisions if isinstance(d, kind)]

    def assert_nothing_leaks(self) -> None:
        """Sleep the engine (drain), then nothing may be held: no block reference, lease,
        load record, checkpoint or pin."""
        self.run([ev.DrainRequested()])
        state = self.engine.state
        state.check_invariants()
        assert state.sleeping
        assert int(state.pool.ref.sum()) == 0, "blocks still referenced after the drain"
        assert not state.transfers.leases and not state.transfers.loads
        assert not state.ckpts.ckpts
        assert not any(len(s.held) for s in state.sessions.sessions.values())
        self.run([ev.WakeRequested()])
