"""TTFT logs recorded before the prefill-turn policies still verify.

``old_logs/ttft-9dba793-*.kvlog`` were recorded by commit 9dba793, where the TTFT order sized
a waiting request by its whole context (session history included) and took one long prompt
first on every step, with

    PYTHONPATH=<a checkout of 9dba793>/src python3 -m tests.replay.test_old_ttft_logs

(this module's ``record``: sessions whose follow-ups find their history cached, and short and
long prompts arriving together, so that the order matters). 9dba793's schema 4 was never
released: a log of that behaviour is a log of schema 3, so the tests give it a schema 3 header
and expect ``SchedulerConfig.from_log_header`` to pin the old order.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine, create_log
from kvsched.events import types as ev
from kvsched.events.log import EventLog, read_log
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.replay.verify import verify_log

HERE = Path(__file__).resolve().parent / "old_logs"
VOCAB = 500


def _config(hybrid: bool) -> SchedulerConfig:
    return SchedulerConfig(
        model=ModelSpec(vocab_size=VOCAB, max_context=1024),
        block_size=16,
        num_blocks=256,
        max_batch=6,
        max_prefill_tokens=64,
        order="ttft",
        hybrid=hybrid,
    )


def _arrivals(step: int, rng: np.random.Generator, next_id: list[int]) -> list[ev.Event]:
    """Step ``step``'s arrivals: every 8 steps each of 3 sessions takes a turn (a long first
    prompt, then short follow-ups), and every step may bring a fresh short or long prompt."""
    out: list[ev.Event] = []

    def arrive(n: int, session: int = -1, max_tokens: int = 6) -> None:
        prompt = rng.integers(1, VOCAB, n, dtype=np.int32)
        out.append(
            ev.RequestArrived(
                next_id[0], prompt, max_tokens, arrival_time=step * 0.01, session_id=session
            )
        )
        next_id[0] += 1

    if step % 8 == 0 and step < 48:
        for session in range(3):
            arrive(150 if step == 0 else int(rng.integers(4, 20)), session, max_tokens=20)
    if step < 48 and rng.random() < 0.6:
        arrive(int(rng.choice([20, 40, 60, 130, 260])))
    return out


def record(path: Path, hybrid: bool) -> None:
    config = _config(hybrid)
    log = create_log(str(path), config)
    engine = Engine(config, log=log)
    executor = SimulatedExecutor(VOCAB)
    rng, next_id = np.random.default_rng(16), [0]
    outcome: list[ev.Event] = []
    for step in range(400):
        inputs = [*outcome, *_arrivals(step, rng, next_id)]
        if step == 48:
            inputs += [ev.SessionEnded(s) for s in range(3)]
        if step > 48 and not engine.has_work and not outcome:
            break
        result = engine.step(inputs, step * 0.01)
        outcome = [] if result.plan.is_empty else [executor.execute(result.plan)]
    log.close()


def _with_schema(source: Path, target: Path, version: int) -> Path:
    old = read_log(source)
    header = old.header
    with EventLog.create(
        target,
        schema_version=version,
        kvsched_version=str(header["kvsched_version"]),
        config=header["config"],
    ) as log:
        for payload in old.records:
            log.append(payload)
    return target


def test_ttft_logs_recorded_before_the_prefill_turns_verify_with_their_old_order(
    tmp_path: Path,
) -> None:
    for kind in ("attention", "hybrid"):
        source = HERE / f"ttft-9dba793-{kind}.kvlog"
        assert read_log(source).header["config"]["order"] == "ttft"
        old = verify_log(str(_with_schema(source, tmp_path / f"{kind}-3.kvlog", 3)))
        assert old.divergence is None, old.divergence.describe()
        assert old.steps == len(read_log(source).records) > 40
        assert old.config.legacy.ttft_size == "context" and old.config.turns.policy == "long_first"
        # Replayed under today's TTFT order, the same log diverges: the pin is what holds.
        now = verify_log(str(_with_schema(source, tmp_path / f"{kind}-4.kvlog", 4)))
        assert now.divergence is not None


if __name__ == "__main__":
    for kind in ("attention", "hybrid"):
        record(HERE / f"ttft-9dba793-{kind}.kvlog", hybrid=kind == "hybrid")
    sys.exit(0)
