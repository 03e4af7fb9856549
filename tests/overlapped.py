"""Overlapped steps (``speculation.pipelined``, vLLM's async scheduling) for the property
machines: the machine's engine rebuilt with them, and a step whose outcome is an input of the
step after next (the engine machines' and the external-KV machines' alike)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from kvsched.engine import Engine

T = TypeVar("T")


def overlap(machine: Any) -> None:
    """The machine's engine again, with overlapped steps; ``machine.older`` holds the
    outcome of the step before the latest."""
    speculation = attrs.evolve(machine.config.speculation, pipelined=True)
    machine.config = attrs.evolve(machine.config, speculation=speculation)
    machine.engine = Engine(machine.config, check_invariants=True)
    machine.older = []


def step_after_next(machine: Any, step: Callable[[], T]) -> T:
    """Run ``step``, which feeds ``machine.outcome`` to the engine and sets it to the new
    step's outcome, so that the outcome fed is the one of the step before the latest."""
    newer, machine.outcome = machine.outcome, machine.older
    result = step()
    machine.older, machine.outcome = newer, machine.outcome
    return result
