"""Replay of an adapter-style event log (``integrations/vllm/logreplay.py``), without vLLM: a
run recorded by kvsched's own engine under the adapter's settings, replayed from its log."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvsched.config import Checkpoints, ModelSpec, SchedulerConfig
from kvsched.engine import Engine, create_log
from kvsched.events.types import RequestArrived
from kvsched.gpu.sim import CostModel, SimulatedExecutor
from kvsched.headers import ConfigError
from kvsched.integrations.vllm.fidelity import BATCH_GAP_S
from kvsched.integrations.vllm.logreplay import policy_config, read_run, replay_log
from kvsched.replay.runs import replay
from kvsched.replay.workload import Turn, Workload

BLOCK = 64
VOCAB = 512


def _config(hybrid: bool, blocks: int = 40, budget: int = 3) -> SchedulerConfig:
    """An adapter-like config: vLLM's caching at planning, the adapter's preset."""
    config = SchedulerConfig(
        model=ModelSpec(name="logreplay", vocab_size=VOCAB, max_context=2048),
        block_size=BLOCK,
        num_blocks=blocks,
        max_batch=4,
        max_prefill_tokens=1024,
        hybrid=hybrid,
        checkpoints=Checkpoints(budget=budget) if hybrid else Checkpoints(),
    )
    return policy_config(config, "vllm-kvsched")


def _workload() -> Workload:
    """A shared prefix: one user, then three together, then strangers, then two users."""
    rng = np.random.default_rng(7)
    system = rng.integers(3, 500, 3 * BLOCK + 20).tolist()
    batches = [["u"], ["u", "u", "u"], ["s", "s", "s", "s"], ["u", "u"]]
    turns, seq = [], 0
    for b, kinds in enumerate(batches):
        for kind in kinds:
            own = rng.integers(3, 500, int(rng.integers(20, 150))).tolist()
            prompt = (system + own) if kind == "u" else rng.integers(3, 500, 150).tolist()
            req = RequestArrived(
                seq_id=seq, prompt=np.asarray(prompt, np.int32), max_tokens=8, arrival_time=0.0
            )
            turns.append(Turn(req, arrival_s=b * BATCH_GAP_S))
            seq += 1
    return Workload("logreplay", tuple(turns))


def _record(path: Path, config: SchedulerConfig) -> None:
    log = create_log(str(path), config)
    try:
        replay(Engine(config, log=log), SimulatedExecutor(VOCAB, CostModel()), _workload())
    finally:
        log.close()


@pytest.mark.parametrize("hybrid", [True, False])
def test_an_adapter_log_replayed_under_its_preset_hits_what_the_run_hit(
    tmp_path: Path, hybrid: bool
) -> None:
    path = tmp_path / "run.kvlog"
    _record(path, _config(hybrid))
    run = read_run(str(path))
    logged = [run.cached.get(e.seq_id) for _, e in run.arrivals]
    assert sum(v or 0 for v in logged) > 0  # the workload hits
    replayed = replay_log(str(path))
    assert [b for a, b in zip(logged, replayed, strict=True) if a is not None] == [
        a for a in logged if a is not None
    ]


def test_a_log_read_for_replay_groups_arrivals_by_the_step_they_arrived_in(tmp_path: Path):
    path = tmp_path / "run.kvlog"
    _record(path, _config(True))
    batches = [b for b, _ in read_run(str(path)).arrivals]
    assert batches == [0, 1, 1, 1, 2, 2, 2, 2, 3, 3]


def test_replaying_a_log_under_an_unknown_policy_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "run.kvlog"
    _record(path, _config(False))
    with pytest.raises(ConfigError, match="no-such-policy"):
        replay_log(str(path), "no-such-policy")


def test_lru_checkpoint_eviction_replayed_from_the_log_loses_the_shared_state(tmp_path: Path):
    # four strangers' states overflow 3 checkpoint slots: value eviction (the preset) keeps
    # the shared prefix's state, LRU drops it (the last users of the prefix miss)
    path = tmp_path / "run.kvlog"
    _record(path, _config(True, budget=3))
    kept, lru = replay_log(str(path)), replay_log(str(path), eviction="lru")
    assert kept[-1] == lru[1] > 0
    assert sum(lru) < sum(kept)
