"""Reducers: the owners of mutable state and the pure folds of events into them."""

from kvsched.reducers.blocks import NULL_BLOCK, BlockPool, BlockPoolError
from kvsched.reducers.errors import InvariantError, RefChange, ReplayMismatch
from kvsched.reducers.inputs import InputError
from kvsched.reducers.planner import plan_step
from kvsched.reducers.sequences import Seq, SequenceTable
from kvsched.reducers.state import EngineState

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "BlockPoolError",
    "EngineState",
    "InputError",
    "InvariantError",
    "RefChange",
    "ReplayMismatch",
    "Seq",
    "SequenceTable",
    "plan_step",
]
