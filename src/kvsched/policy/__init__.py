"""Scheduling policy: prefill order, admission under budgets, chunking, matching, preemption."""

from kvsched.policy.ordering import PrefillOrder
from kvsched.policy.scheduler import Chunk, Policy

__all__ = ["Chunk", "Policy", "PrefillOrder"]
