"""Prefill ordering policies: the order in which waiting sequences are offered admission.

* ``fcfs``: arrival order.
* ``priority``: higher priority first; waiting ages a request up one level per ``aging_s``.
* ``ttft``: size-aware (lmdeploy's TTFT policy): one long prompt first, then short prompts by
  size, then the other long prompts; a long prompt's rank improves with its wait, so long
  prompts are never starved.
"""

from __future__ import annotations

from kvsched.config import SchedulerConfig
from kvsched.reducers.sequences import Seq


def _age_levels(config: SchedulerConfig, seq: Seq, clock: float) -> int:
    return int(max(0.0, clock - seq.arrival_time) // config.aging_s)


def order_waiting(config: SchedulerConfig, waiting: list[Seq], clock: float) -> list[Seq]:
    if config.order == "fcfs":
        return sorted(waiting, key=lambda s: (s.arrival_time, s.seq_id))
    if config.order == "priority":
        return sorted(
            waiting,
            key=lambda s: (-(s.priority + _age_levels(config, s, clock)), s.arrival_time, s.seq_id),
        )
    return _order_ttft(config, waiting, clock)


def _order_ttft(config: SchedulerConfig, waiting: list[Seq], clock: float) -> list[Seq]:
    chunk = config.chunk_tokens
    shorts = [s for s in waiting if s.n_tokens <= chunk]
    longs = [s for s in waiting if s.n_tokens > chunk]
    shorts.sort(key=lambda s: (s.n_tokens, s.arrival_time, s.seq_id))

    def long_key(s: Seq) -> tuple[int, int, float, int]:
        chunks = -(-s.n_tokens // chunk)
        return (chunks - _age_levels(config, s, clock), chunks, s.arrival_time, s.seq_id)

    longs.sort(key=long_key)
    return longs[:1] + shorts + longs[1:]
