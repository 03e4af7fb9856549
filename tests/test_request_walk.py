"""scripts/request_walk.py: the documented walk of one request cannot silently grow back."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("request_walk", ROOT / "scripts/request_walk.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documented() -> tuple[int, int]:
    text = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    found = re.search(r"Now: \*\*(\d+) functions in (\d+) files\*\*", text)
    assert found, "docs/architecture.md: 'The walk of one request' states no count"
    return int(found[1]), int(found[2])


def test_the_request_walk_is_no_longer_than_the_architecture_doc_says() -> None:
    functions = _script().walk().functions()
    limit, _ = _documented()
    assert len(functions) <= limit, (
        f"one request now passes {len(functions)} functions, the docs say {limit}: shorten the "
        "path, or regenerate the walk in docs/architecture.md (scripts/request_walk.py)"
    )


def test_the_request_walk_starts_at_the_engine_step_and_ends_the_sequence() -> None:
    walk = _script().walk()
    functions = walk.functions()
    assert functions[0] == "engine.py:Engine.step"
    assert "policy/growth.py:Growth.end" in functions
    assert len(functions) == len(set(functions))  # each function once, at its first call
    assert all(not name.split(":")[1].startswith("<") for name in functions)
