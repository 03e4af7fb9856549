"""Render the state machines as markdown + mermaid (docs/statemachines.md).

Usage: ``python -m kvsched.statemachines.diagrams [--check] [PATH]``.
Edges are read back from each machine's loaded ``transitions.Machine``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from enum import IntEnum
from pathlib import Path
from typing import NamedTuple

from kvsched.statemachines.declare import CompiledMachine
from kvsched.statemachines.machines import ALL_MACHINES
from kvsched.statemachines.triggers import EVENT_TRIGGERS

__all__ = [
    "DEFAULT_PATH",
    "REGENERATE_COMMAND",
    "Edge",
    "edges",
    "main",
    "render_all",
    "render_machine",
]

DEFAULT_PATH = "docs/statemachines.md"
REGENERATE_COMMAND = "PYTHONPATH=src python3 -m kvsched.statemachines.diagrams"


class Edge(NamedTuple):
    """One rendered edge."""

    source: IntEnum
    event: IntEnum
    guard: str | None
    dest: IntEnum


def edges(compiled: CompiledMachine) -> list[Edge]:
    """Edges of the loaded ``transitions.Machine``, sorted by (source, event, guard)."""
    states, events = compiled.spec.states, compiled.spec.events
    found = [
        Edge(states[source], events[name], _guard_of(t), states[t.dest])
        for name, event in compiled.machine.events.items()
        for source, ts in event.transitions.items()
        for t in ts
    ]
    return sorted(found, key=lambda e: (e.source, e.event, e.guard or ""))


def _guard_of(t: object) -> str | None:
    conditions = getattr(t, "conditions", [])
    return str(conditions[0].func) if conditions else None


def _label(e: Edge) -> str:
    return f"{e.event.name} [{e.guard}]" if e.guard else e.event.name


def _mermaid(compiled: CompiledMachine) -> list[str]:
    spec = compiled.spec
    lines = ["```mermaid", "stateDiagram-v2"]
    lines += [f"    [*] --> {s.name}" for s in spec.initial]
    lines += [f"    {e.source.name} --> {e.dest.name}: {_label(e)}" for e in edges(compiled)]
    lines += [f"    {s.name} --> [*]" for s in sorted(spec.terminal)]
    lines.append("```")
    return lines


def _table(compiled: CompiledMachine) -> list[str]:
    lines = ["| from | event | guard | to |", "| --- | --- | --- | --- |"]
    for e in edges(compiled):
        guard = f"`{e.guard}`" if e.guard else ""
        lines.append(f"| {e.source.name} | `{e.event.name}` | {guard} | {e.dest.name} |")
    return lines


def render_machine(compiled: CompiledMachine) -> str:
    """Markdown section (summary, mermaid diagram, transition table) for one machine."""
    spec = compiled.spec
    initial = ", ".join(s.name for s in spec.initial)
    terminal = ", ".join(s.name for s in sorted(spec.terminal)) or "none"
    lines = [f"## {spec.name}", ""]
    if spec.description:
        lines += [spec.description, ""]
    lines += [f"- States: `{spec.states.__name__}`; events: `{spec.events.__name__}`"]
    lines += [f"- Initial: {initial}", f"- Terminal: {terminal}", ""]
    lines += [*_mermaid(compiled), "", *_table(compiled), ""]
    return "\n".join(lines)


def render_triggers() -> str:
    """The declared map of which event fires which trigger (``triggers.py``)."""
    lines = [
        "## Events and the triggers they fire",
        "",
        "Declared in `src/kvsched/statemachines/triggers.py` and checked when it is imported:",
        "every trigger of every machine is fired by some event, and every trigger an event",
        "fires is used by a transition of its machine. Folds look triggers up here.",
        "",
        "| event | machine | triggers |",
        "| --- | --- | --- |",
    ]
    for kind, per_machine in EVENT_TRIGGERS.items():
        for machine, triggers in per_machine.items():
            names = ", ".join(f"`{t.name}`" for t in triggers)
            lines.append(f"| `{kind.__name__}` | {machine.name} | {names} |")
    return "\n".join([*lines, ""])


def render_all(machines: Iterable[CompiledMachine] = ALL_MACHINES) -> str:
    """The whole generated document."""
    header = [
        "<!-- GENERATED FILE: do not edit by hand. -->",
        f"<!-- Regenerate with: {REGENERATE_COMMAND} -->",
        "",
        "# State machines",
        "",
        "Generated from `src/kvsched/statemachines/machines.py` by",
        f"`{REGENERATE_COMMAND}`. Edit the declarations, then regenerate.",
        "",
    ]
    body = "\n".join(render_machine(m) for m in machines)
    return "\n".join(header) + "\n" + body + "\n" + render_triggers()


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: write the document, or with ``--check`` report whether it is stale."""
    parser = argparse.ArgumentParser(prog="python -m kvsched.statemachines.diagrams")
    parser.add_argument("--check", action="store_true", help="exit 1 if PATH is out of date")
    parser.add_argument("path", nargs="?", default=DEFAULT_PATH, help=f"default {DEFAULT_PATH}")
    args = parser.parse_args(argv)
    path, text = Path(args.path), render_all()
    if args.check:
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != text:
            print(f"{path} is stale; regenerate with: {REGENERATE_COMMAND}", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
