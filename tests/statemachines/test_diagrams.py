"""The generated docs/statemachines.md and the renderer behind it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsched.statemachines import ALL_MACHINES, CHECKPOINT, SEQUENCE, CompiledMachine
from kvsched.statemachines.diagrams import (
    REGENERATE_COMMAND,
    edges,
    main,
    render_all,
    render_machine,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "statemachines.md"


def test_the_committed_docs_file_is_not_stale() -> None:
    assert DOCS.is_file(), f"{DOCS} is missing; generate it with: {REGENERATE_COMMAND}"
    assert DOCS.read_text(encoding="utf-8") == render_all(), (
        f"{DOCS} is stale; regenerate it with: {REGENERATE_COMMAND}"
    )


def test_rendering_is_deterministic() -> None:
    assert render_all() == render_all()


def test_the_document_says_it_is_generated_and_how_to_regenerate_it() -> None:
    first_lines = render_all().splitlines()[:2]
    assert "GENERATED" in first_lines[0]
    assert REGENERATE_COMMAND in first_lines[1]


def test_every_machine_gets_a_section_with_a_mermaid_diagram_and_a_table() -> None:
    text = render_all()
    for m in ALL_MACHINES:
        section = render_machine(m)
        assert section in text
        assert "```mermaid\nstateDiagram-v2\n" in section
        assert "| from | event | guard | to |" in section


def test_the_diagram_marks_initial_and_terminal_states() -> None:
    section = render_machine(SEQUENCE)
    assert "[*] --> WAITING" in section
    assert "[*] --> LOADING_KV" not in section
    assert "FINISHED --> [*]" in section
    assert "ABORTED --> [*]" in section


def test_guarded_edges_are_labelled_with_their_guard() -> None:
    section = render_machine(CHECKPOINT)
    assert "PINNED --> PUBLISHED: unpin [last_pin]" in section
    assert "| PINNED | `unpin` | `more_pins` | PINNED |" in section


@pytest.mark.parametrize("m", ALL_MACHINES, ids=lambda m: m.name)
def test_the_rendered_edges_are_exactly_the_declared_transitions(m: CompiledMachine) -> None:
    rendered = {(e.source, e.event, e.guard, e.dest) for e in edges(m)}
    declared = {(t.source, t.event, t.guard, t.dest) for t in m.spec.transitions}
    assert rendered == declared
    assert len(edges(m)) == len(m.spec.transitions)


def test_the_cli_writes_the_file_and_check_passes_afterwards(tmp_path: Path) -> None:
    target = tmp_path / "out" / "statemachines.md"
    assert main(["--check", str(target)]) == 1
    assert main([str(target)]) == 0
    assert target.read_text(encoding="utf-8") == render_all()
    assert main(["--check", str(target)]) == 0


def test_the_cli_check_fails_on_a_stale_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "statemachines.md"
    target.write_text(render_all() + "edited by hand\n", encoding="utf-8")
    assert main(["--check", str(target)]) == 1
    assert REGENERATE_COMMAND in capsys.readouterr().err
