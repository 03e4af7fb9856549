"""Crash recovery: rebuild an engine from its event log and continue the run.

The log's complete steps are replayed through a fresh engine (every decision is checked
against the logged one, as in ``verify``); a torn tail is cut off; the log is reopened for
appending; and the last complete step's plan, whose outcome died with the crashed process, is
rebuilt from the state so the driver can execute it again.
"""

from __future__ import annotations

import attrs

from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.events.log import EventLog, TornTail, read_log
from kvsched.reducers.planner import plan_step
from kvsched.replay.driver import Resume, _ended
from kvsched.replay.verify import is_legacy, load_config, replay_record


class RecoveryError(RuntimeError):
    """The log does not replay to the decisions it records."""


@attrs.frozen
class Recovered:
    engine: Engine
    resume: Resume
    steps: int
    torn_tail: TornTail | None


def recover(path: str, *, check_invariants: bool = False) -> Recovered:
    """Raises RecoveryError if the log does not replay to what it records (or LogError if
    this kvsched cannot replay it at all)."""
    contents = read_log(path)
    config = load_config(contents.header, path)
    legacy = is_legacy(contents.header)
    engine = Engine(config, check_invariants=check_invariants)
    arrived: set[int] = set()
    ended_at: dict[int, float] = {}
    clock = 0.0
    steps = 0
    for offset, payload in zip(contents.offsets, contents.records, strict=True):
        replayed, divergence = replay_record(engine, offset, payload, steps + 1, legacy)
        if replayed is None:  # checked as verify checks it: decisions, plan digest, step
            assert divergence is not None
            raise RecoveryError(divergence.describe())
        record, result = replayed
        inputs: list[ev.Event] = list(record.inputs)
        for event in inputs:
            if isinstance(event, ev.RequestArrived):
                arrived.add(event.seq_id)
        ended_at.update((seq_id, record.clock) for seq_id in _ended(result.decisions))
        clock = record.clock
        steps += 1
    engine.log = EventLog.open_append(path)
    resume = Resume(frozenset(arrived), ended_at, clock, plan_step(engine.state))
    return Recovered(engine, resume, steps, contents.torn_tail)
