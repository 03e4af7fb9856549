"""A cluster what-if's own report files, beside the sweep's (``report.write_sweep``: hit rate
and TTFT against the engine count, one line per route): ``engines.md``, each run's engines one
row each, and ``balance.png``, how each route spread requests and computed prefill tokens
over the engines of its largest run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsched.replay.report import DPI, POLICY_COLOURS, pyplot

ENGINES_TABLE = "engines.md"
BALANCE_PLOT = "balance.png"


def write_cluster(out_dir: str | Path, runs: Sequence[dict[str, Any]], title: str) -> list[Path]:
    """engines.md and balance.png for the cluster runs ``runs`` (their metrics)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / ENGINES_TABLE).write_text(engines_markdown(title, runs))
    plt = pyplot()
    fig = balance_figure(runs, title)
    fig.savefig(out / BALANCE_PLOT, dpi=DPI)
    plt.close(fig)
    return [out / ENGINES_TABLE, out / BALANCE_PLOT]


def engines_markdown(title: str, runs: Sequence[dict[str, Any]]) -> str:
    """Per run, a table with a row per engine: requests, token hit rate, TTFT p50 / p99
    and computed prefill tokens (simulated clock)."""
    parts = [f"# {title}: each engine"]
    for m in runs:
        parts += [
            "",
            f"## {m['route']}, {_engines(m['engines'])}: {100 * m['token_hit_rate']:.1f} % hit, "
            f"TTFT p50 / p99 {1000 * m['ttft_p50_s']:,.0f} / {1000 * m['ttft_p99_s']:,.0f} ms",
            "",
            "| engine | requests | hit rate | TTFT p50 | TTFT p99 | prefill tokens |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for k, e in enumerate(m["per_engine"]):
            parts.append(
                f"| {k} | {e['requests']:,} | {100 * e['token_hit_rate']:.1f} % | "
                f"{1000 * e['ttft_p50_s']:,.0f} ms | {1000 * e['ttft_p99_s']:,.0f} ms | "
                f"{e['prefill_tokens']:,} |"
            )
    return "\n".join(parts) + "\n"


def balance_figure(runs: Sequence[dict[str, Any]], title: str) -> Any:
    """Two panels for the largest engine count: requests and computed prefill tokens per
    engine (engines sorted from most to least loaded), one line per route; an even spread
    is flat."""
    plt = pyplot()
    most = max((m["engines"] for m in runs), default=1)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    mine = [m for m in runs if m["engines"] == most]
    routes = list(dict.fromkeys(m["route"] for m in runs))  # (sweep.png's colours)
    for m in mine:
        colour = POLICY_COLOURS[routes.index(m["route"]) % len(POLICY_COLOURS)]
        for ax, key in zip(axes, ("requests", "prefill_tokens"), strict=True):
            values = sorted((e[key] for e in m["per_engine"]), reverse=True)
            ax.plot(range(len(values)), values, marker="o", color=colour, label=m["route"])
    for ax, label in zip(axes, ("requests", "computed prefill tokens"), strict=True):
        ax.set(xlabel="engine (most loaded first)", ylabel=label, ylim=(0, None))
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(frameon=False)
    fig.suptitle(f"{title}: load per engine, {_engines(most)}")
    fig.tight_layout()
    return fig


def _engines(n: int) -> str:
    return f"{n} engine" + ("s" if n != 1 else "")
