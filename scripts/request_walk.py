"""The request walk: the kvsched functions one plain request passes, arrival to finish.

    PYTHONPATH=src python3 scripts/request_walk.py [--count]

One request (a 40-token prompt, ``max_tokens`` 3) arrives at an attention-model engine with
default options (16-token blocks, 1,024-token context); each step's plan runs on the simulated
executor and its outcome is the next step's input, until the engine has no work left. Only the
``Engine.step`` calls are traced (not the engine's construction, not the executor).

The rule, fixed so that two trees compare:
- a function counts if it is defined in ``kvsched/engine.py``, ``kvsched/plan.py`` or under
  ``kvsched/reducers/``, ``kvsched/policy/`` or ``kvsched/statemachines/`` (the scheduler's own
  path); the event classes, containers, identity kernels, logs and sinks live elsewhere;
- it counts once, at its first call, under the step that first called it;
- it does not count if it is a trivial accessor: decorated ``@property`` (or a setter), or a
  body (its docstring aside) of one statement that calls nothing (a one-line getter or
  setter: ``return self.x``, ``self.step = e.step``);
- comprehensions, generator expressions, lambdas and generated code (attrs' ``__init__``)
  are not functions here.

Prints the walk grouped by step (``file:function``), then the totals; ``--count`` prints only
``FUNCTIONS FILES``.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
from types import CodeType, FrameType
from typing import Any

import numpy as np

import kvsched
from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor

ROOT = os.path.dirname(os.path.abspath(kvsched.__file__))
SCOPE_FILES = ("engine.py", "plan.py")
SCOPE_DIRS = ("reducers", "policy", "statemachines")


def in_scope(path: str) -> str | None:
    """The path relative to the package if the rule counts functions in it, else None."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    if rel in SCOPE_FILES or rel.split(os.sep)[0] in SCOPE_DIRS:
        return rel.replace(os.sep, "/")
    return None


@functools.cache
def _defs(path: str) -> dict[tuple[int, str], ast.FunctionDef | ast.AsyncFunctionDef]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found: dict[tuple[int, str], ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            found[(first, node.name)] = node
            found[(node.lineno, node.name)] = node
    return found


def _is_property(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for d in node.decorator_list:
        name = d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else ""
        if name in ("property", "cached_property", "setter"):
            return True
    return False


def trivial(code: CodeType) -> bool:
    """A property, or one statement (docstring aside) that calls nothing."""
    node = _defs(code.co_filename).get((code.co_firstlineno, code.co_name))
    if node is None:
        return False
    if _is_property(node):
        return True
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if len(body) != 1 or isinstance(body[0], (ast.If, ast.For, ast.While, ast.With, ast.Try)):
        return False
    return not any(isinstance(n, ast.Call) for n in ast.walk(body[0]))


class Walk:
    def __init__(self) -> None:
        self.seen: set[CodeType] = set()
        self.steps: list[tuple[str, list[str]]] = []

    def profile(self, frame: FrameType, event: str, _: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code in self.seen:
            return
        self.seen.add(code)
        rel = in_scope(code.co_filename)
        if rel is None or code.co_name.startswith("<") or trivial(code):
            return
        qualname = getattr(code, "co_qualname", code.co_name)
        self.steps[-1][1].append(f"{rel}:{qualname}")

    def step(self, engine: Engine, inputs: list[ev.Event], clock: float) -> Any:
        names = ", ".join(type(e).__name__ for e in inputs) or "no input"
        self.steps.append((f"step {engine.state.step + 1} ({names})", []))
        sys.setprofile(self.profile)
        try:
            return engine.step(inputs, clock)
        finally:
            sys.setprofile(None)

    def functions(self) -> list[str]:
        return [f for _, fs in self.steps for f in fs]


def walk() -> Walk:
    config = SchedulerConfig(
        model=ModelSpec(vocab_size=1000, max_context=1024), block_size=16, num_blocks=256
    )
    engine, executor = Engine(config), SimulatedExecutor(config.model.vocab_size)
    prompt = np.random.default_rng(0).integers(1, 1000, 40, dtype=np.int32)
    record = Walk()
    inputs: list[ev.Event] = [ev.RequestArrived(1, prompt, 3)]
    clock = 0.0
    for _ in range(100):
        result = record.step(engine, inputs, clock)
        inputs = []
        if not result.plan.is_empty:
            executed = executor.execute(result.plan)
            inputs = [executed]
            clock += executed.duration_s
        if not inputs and not engine.has_work:
            return record
    raise RuntimeError("the request did not finish in 100 steps")


def main(argv: list[str]) -> int:
    record = walk()
    functions = record.functions()
    files = {f.split(":")[0] for f in functions}
    if argv[1:] == ["--count"]:
        print(len(functions), len(files))
        return 0
    for title, fs in record.steps:
        if fs:
            print(f"{title}:")
            for f in fs:
                print(f"  {f}")
    print(f"{len(functions)} functions in {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
