"""Replay of the adapter's event log: the arrivals of a kvsched-under-vLLM run, replayed in
kvsched's simulation under a checkpoint policy, with the run's own outputs as the executor's
tokens; each request's cached prompt tokens compared with the run's (docs/vllm.md, "Replay of
the adapter's logs"). No vLLM needed.

    python -m kvsched.integrations.vllm.logreplay run.kvlog [--policy vllm-kvsched]

The log's header config (vLLM's block size, pool, token budget, the adapter's split of the
block ids) is the replay's, under the named policy. Requests that arrive in one step (one
``LLM.generate`` call) are one batch; a batch arrives after the previous one finished
(``fidelity.BATCH_GAP_S``), as the offline workloads submit them. Cached tokens are those of
each sequence's first admission (``SequenceFinished`` / ``SequenceAborted``, vLLM's
``num_cached_tokens``), in the run's log and in the replay alike; the tests compare the
replay with the run's ``num_cached_tokens`` request by request. Other inputs (aborts,
``reset_prefix_cache``'s drain, ``AdmissionsHeld`` from a pause) are not replayed: this is a
what-if under another policy, not a re-execution (``kvsched verify`` re-executes a log).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import attrs

from kvsched.config import SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.events.bus import EventBus
from kvsched.events.codec import decode_record
from kvsched.events.inputs import StepExecuted
from kvsched.events.log import LogReader
from kvsched.integrations.vllm.config import PRESET
from kvsched.integrations.vllm.fidelity import BATCH_GAP_S, RecordedOutputs
from kvsched.replay.runs import replay
from kvsched.replay.verify import load_config
from kvsched.replay.workload import Turn, Workload


@attrs.frozen
class LoggedRun:
    """What a replay needs of an adapter log: its config, each arrival with its batch (the
    index of the step record it arrived in, counting only records with arrivals), each
    sequence's sampled tokens in order, and each sequence's logged cached tokens."""

    config: SchedulerConfig
    arrivals: tuple[tuple[int, ev.RequestArrived], ...]
    outputs: dict[int, list[int]]
    cached: dict[int, int]


def _cached_of(d: ev.Event) -> dict[int, int]:
    """Cached prompt tokens (local + checkpoint) a retirement decision reports, by sequence."""
    if isinstance(d, ev.SequenceFinished):
        local, ckpt = d.cached_local.tolist(), d.cached_checkpoint.tolist()
        if len(local) != len(d.seq_ids):  # (logs before schema 4: no counts)
            return {}
        return {s: a + b for s, a, b in zip(d.seq_ids.tolist(), local, ckpt, strict=True)}
    if isinstance(d, ev.SequenceAborted):
        return {d.seq_id: d.cached_local + d.cached_checkpoint}
    return {}


def read_run(path: str) -> LoggedRun:
    """The arrivals, outputs and cached tokens recorded in the event log at ``path``."""
    reader = LogReader(path)
    config = load_config(reader.header, path)
    arrivals: list[tuple[int, ev.RequestArrived]] = []
    outputs: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    batch = -1
    for _, payload in reader:
        record = decode_record(payload)
        inputs: list[Any] = list(record.inputs)  # (the codec's union type is opaque to mypy)
        new = [e for e in inputs if isinstance(e, ev.RequestArrived)]
        batch += bool(new)
        arrivals.extend((batch, e) for e in new)
        for done in inputs:
            if isinstance(done, StepExecuted):
                for s, t in zip(done.seq_ids.tolist(), done.tokens.tolist(), strict=True):
                    outputs.setdefault(s, []).append(t)
        for d in record.decisions:
            cached.update(_cached_of(d))
    return LoggedRun(config, tuple(arrivals), outputs, cached)


def replay_run(run: LoggedRun, config: SchedulerConfig) -> dict[int, int]:
    """Each sequence's cached prompt tokens when ``config`` replays the run's arrivals in
    batches, the run's outputs as the executor's tokens."""
    executor = RecordedOutputs(
        {e.seq_id: len(e.prompt) for _, e in run.arrivals},
        run.outputs,
        config.model.vocab_size,
    )
    turns = tuple(Turn(e, arrival_s=batch * BATCH_GAP_S) for batch, e in run.arrivals)
    bus: EventBus[ev.Event] = EventBus()
    cached: dict[int, int] = {}
    bus.subscribe(lambda e: cached.update(_cached_of(e)), name="cached")
    replay(Engine(config, bus=bus), executor, Workload("adapter-log", turns))
    return cached


def policy_config(config: SchedulerConfig, policy: str) -> SchedulerConfig:
    """``config`` under the named policy: its checkpoint rules and engine settings for a
    hybrid model, its engine settings only for an attention-only one (no checkpoints)."""
    if config.hybrid:
        return config.with_checkpoint_policy(policy)
    return config.with_engine_settings(policy)


def replay_log(path: str, policy: str = PRESET, **checkpoints: Any) -> list[int]:
    """Each request's cached prompt tokens, in arrival order, when the log's arrivals are
    replayed under its header config and checkpoint ``policy``, with ``checkpoints``
    settings over the policy's (e.g. ``eviction="lru"``)."""
    run = read_run(path)
    config = policy_config(run.config, policy)
    if checkpoints:
        config = attrs.evolve(config, checkpoints=attrs.evolve(config.checkpoints, **checkpoints))
    cached = replay_run(run, config)
    return [cached[e.seq_id] for _, e in run.arrivals]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("log")
    p.add_argument("--policy", default=PRESET)
    args = p.parse_args(argv)
    run, replayed = read_run(args.log), replay_log(args.log, args.policy)
    # (the log of an engine shut down right after its last request finished has no
    # retirement of that request: vLLM's num_cached_tokens names it)
    logged = [run.cached.get(e.seq_id) for _, e in run.arrivals]
    same = all(a is None or a == b for a, b in zip(logged, replayed, strict=True))
    print(json.dumps({"run": logged, "replay": replayed, "same": same}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
