"""Reducers: the owners of mutable state and the pure folds of events into them."""

from kvsched.reducers.blocks import NULL_BLOCK, BlockPool, BlockPoolError
from kvsched.reducers.plan import StepPlan, plan_step
from kvsched.reducers.sequences import Seq, SequenceTable
from kvsched.reducers.state import EngineState, InvariantError, ReplayMismatch

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "BlockPoolError",
    "EngineState",
    "InvariantError",
    "ReplayMismatch",
    "Seq",
    "SequenceTable",
    "StepPlan",
    "plan_step",
]
