"""Executors: apply StepPlans and report outcomes (simulated here; torch executor to come)."""

from kvsched.gpu.sim import CostModel, SimulatedExecutor

__all__ = ["CostModel", "SimulatedExecutor"]
