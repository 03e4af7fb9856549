"""Sweep points and their labels, and a sweep's markdown table (``sweep.md``): plain text,
no plotting (``report.py`` draws ``sweep.png`` from the same points)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

UNBOUNDED_BUDGET = 1 << 20
"""``--sweep checkpoint-budget=unbounded``: the largest budget the config takes (1,048,576
checkpoints, more than any trace here places), labelled "unbounded"."""


def gib(n: float) -> str:
    """Bytes as GiB, three significant digits."""
    return f"{n / (1 << 30):,.3g} GiB"


def point_label(key: str, value: int) -> str:
    """A sweep value as it reads: sizes in GiB, the unbounded budget as "unbounded"."""
    if key.endswith("memory"):
        return gib(value)
    if key == "checkpoint-budget" and value == UNBOUNDED_BUDGET:
        return "unbounded"
    return f"{value:,}"


_AXES = {
    "checkpoint-budget": "checkpoint budget (states; state memory in GiB below)",
    "checkpoint-memory": "checkpoint memory (GiB)",
}
_SHORT = {"checkpoint-budget": "checkpoint budget (states)"}


def axis_label(key: str) -> str:
    """The x axis label of a sweep plot: checkpoint keys with their units (several keys
    joined by " | "), other keys as given."""
    if "+" in key:
        return " | ".join(_SHORT.get(k, _AXES.get(k, k)) for k in key.split("+"))
    return _AXES.get(key, key)


def sweep_points(
    key: str, values: Sequence[int], runs: Sequence[dict[str, Any]]
) -> list[tuple[str, int]]:
    """The (key, value) points of a sweep in plot and table order: the values as given for
    one key; for several keys (``KEY1+KEY2``) the runs' points in their order."""
    if "+" not in key:
        return [(key, v) for v in values]
    return list(dict.fromkeys((m.get("sweep_key", ""), m.get("sweep_value", 0)) for m in runs))


def _at(m: dict[str, Any], point: tuple[str, int], several: bool) -> bool:
    return m.get("sweep_value") == point[1] and (not several or m.get("sweep_key") == point[0])


def runs_at(
    key: str, point: tuple[str, int], runs: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The runs of one point."""
    return [m for m in runs if _at(m, point, "+" in key)]


def _cell(m: dict[str, Any]) -> str:
    return (
        f"{100 * m['token_hit_rate']:.1f} % · {1000 * m['ttft_p50_s']:,.0f} / "
        f"{1000 * m['ttft_p99_s']:,.0f} ms"
    )


def _row_label(key: str, point: tuple[str, int], runs: Sequence[dict[str, Any]]) -> str:
    """A table row's point: "budget 256 (18.4 GiB)", "memory 16 GiB" or the value."""
    k, v = point
    text = point_label(k, v)
    memory = {int(m.get("state_memory_bytes", -1)) for m in runs_at(key, point, runs)}
    if k == "checkpoint-budget":
        one = len(memory) == 1 and -1 not in memory and v != UNBOUNDED_BUDGET
        return f"budget {text}" + (f" ({gib(float(memory.pop()))})" if one else "")
    if k == "checkpoint-memory":
        return f"memory {text}"
    return text


def sweep_markdown(
    title: str, key: str, values: Sequence[int], runs: Sequence[dict[str, Any]]
) -> str:
    """A markdown table: one row per point, one column per checkpoint policy; cells are
    token hit rate · TTFT p50 / p99 (simulated clock); the sequential ideal below."""
    policies = list(dict.fromkeys(m.get("checkpoint_policy", "") or "replay" for m in runs))
    head = ["| point | " + " | ".join(policies) + " |", "|---|" + "---:|" * len(policies)]
    rows = []
    for point in sweep_points(key, values, runs):
        here = {m.get("checkpoint_policy", "") or "replay": m for m in runs_at(key, point, runs)}
        cells = [_cell(here[p]) if p in here else "-" for p in policies]
        rows.append(f"| {_row_label(key, point, runs)} | " + " | ".join(cells) + " |")
    ideal = runs[0].get("ideal_hit_rate") if runs else None
    foot = [
        "",
        "Cells: token hit rate · TTFT p50 / p99 (simulated clock).",
    ]
    if ideal is not None:
        foot.append(
            f"Sequential ideal (infinite cache, one request at a time): {100 * ideal:.1f} %."
        )
    return "\n".join([f"### {title}", "", *head, *rows, *foot]) + "\n"
