"""Replay: workloads, the driver loop, and record-and-verify of event logs."""

from kvsched.replay.driver import RunSummary, run
from kvsched.replay.verify import Divergence, VerifyResult, first_difference, verify_log
from kvsched.replay.workload import Turn, Workload, chat_workload

__all__ = [
    "Divergence",
    "RunSummary",
    "Turn",
    "VerifyResult",
    "Workload",
    "chat_workload",
    "first_difference",
    "run",
    "verify_log",
]
