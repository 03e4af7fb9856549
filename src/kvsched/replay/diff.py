"""``kvsched diff LOG_A LOG_B``: where two runs' decisions first differ; how their totals differ.

The logs are walked step by step; the first step whose clock, inputs or decisions differ
(msgpack bytes, event by event) is reported with the entity and both events. Totals are
folded from each log's events alone (no engine is run), so logs of different configs or
versions can be compared.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from kvsched.config import SchedulerConfig
from kvsched.events import types as ev
from kvsched.events.codec import StepRecord, check_schema, decode_record, encode, to_builtins
from kvsched.events.log import read_log
from kvsched.replay.verify import Divergence, first_difference


@attrs.frozen
class FirstDifference:
    step: int
    where: str  # "clock", "inputs", "decisions" or "length"
    divergence: Divergence | None
    detail: str = ""

    def describe(self) -> str:
        if self.divergence is not None:
            d = self.divergence
            return (
                f"first difference at step {self.step}, {self.where} #{d.index}, {d.entity}:\n"
                f"  A: {d.logged}\n  B: {d.new}"
            )
        return f"first difference at step {self.step} ({self.where}): {self.detail}"


@attrs.frozen
class DiffResult:
    steps_compared: int
    first: FirstDifference | None
    config_a: dict[str, Any]
    config_b: dict[str, Any]
    totals_a: dict[str, float]
    totals_b: dict[str, float]

    @property
    def identical(self) -> bool:
        return self.first is None

    def config_changes(self) -> dict[str, tuple[Any, Any]]:
        a, b = _flatten(self.config_a), _flatten(self.config_b)
        keys = sorted(a.keys() | b.keys())
        return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}

    def as_dict(self) -> dict[str, Any]:
        first = None
        if self.first is not None:
            d = self.first.divergence
            first = {
                "step": self.first.step,
                "where": self.first.where,
                "index": d.index if d else None,
                "entity": d.entity if d else None,
                "a": d.logged if d else None,
                "b": d.new if d else None,
                "detail": self.first.detail,
            }
        return {
            "identical": self.identical,
            "steps_compared": self.steps_compared,
            "first_difference": first,
            "config_changes": {k: list(v) for k, v in self.config_changes().items()},
            "totals_a": self.totals_a,
            "totals_b": self.totals_b,
        }


def _config_of(header: dict[str, Any]) -> dict[str, Any]:
    """A header's config in today's shape (an old log's flat header read as it ran), so
    that two logs compare setting by setting; the raw config when it does not read."""
    raw = dict(header.get("config") or {})
    try:
        data = SchedulerConfig.from_log_header(raw, int(header["schema_version"])).to_dict()
    except (KeyError, TypeError, ValueError):
        return raw
    data["legacy"].pop("header", None)  # (where the config came from, not a setting)
    return data


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def totals(records: Iterable[StepRecord]) -> dict[str, float]:
    """Run totals folded from a log's events (no engine)."""
    t = {
        "steps": 0,
        "requests": 0,
        "rejected": 0,
        "finished": 0,
        "aborted": 0,
        "preemptions": 0,
        "prefill_tokens": 0,
        "generated_tokens": 0,
        "hit_tokens": 0,
        "query_tokens": 0,
        "sim_time_s": 0.0,
    }
    for r in records:
        t["steps"] += 1
        t["sim_time_s"] = r.clock
        for e in r.inputs:
            if isinstance(e, ev.RequestArrived):
                t["requests"] += 1
            elif isinstance(e, ev.StepExecuted):
                t["generated_tokens"] += len(e.seq_ids)
        for d in r.decisions:
            if isinstance(d, ev.RequestRejected):
                t["rejected"] += 1
            elif isinstance(d, ev.SequenceFinished):
                t["finished"] += len(d.seq_ids)
            elif isinstance(d, ev.SequenceAborted):
                t["aborted"] += 1
            elif isinstance(d, ev.SequencePreempted):
                t["preemptions"] += 1
            elif isinstance(d, ev.PrefillScheduled):
                t["prefill_tokens"] += int((d.ends - d.starts).sum())
            elif isinstance(d, ev.PrefixMatched) and d.num_query_tokens:
                t["hit_tokens"] += d.num_tokens
                t["query_tokens"] += d.num_query_tokens
    q = t["query_tokens"]
    t["token_hit_rate"] = t["hit_tokens"] / q if q else 0.0
    return t


def diff_logs(path_a: str, path_b: str) -> DiffResult:
    """Raises CorruptLogError, OSError, SchemaVersionError or RecordDecodeError for a log
    that cannot be read."""
    a, b = read_log(path_a), read_log(path_b)
    check_schema(a.header, f"event log {path_a}")
    check_schema(b.header, f"event log {path_b}")
    recs_a = [decode_record(r) for r in a.records]
    recs_b = [decode_record(r) for r in b.records]
    first: FirstDifference | None = None
    compared = 0
    for ra, rb in zip(recs_a, recs_b, strict=False):
        if ra.clock != rb.clock:
            first = FirstDifference(
                ra.step, "clock", None, f"A at {ra.clock!r} s, B at {rb.clock!r} s"
            )
        else:
            div = _first_input_difference(ra, rb)
            if div is not None:
                first = FirstDifference(ra.step, "inputs", div)
            else:
                div = first_difference(ra.step, list(ra.decisions), list(rb.decisions))
                if div is not None:
                    first = FirstDifference(ra.step, "decisions", div)
        if first is not None:
            break
        compared += 1
    if first is None and len(recs_a) != len(recs_b):
        step = min(len(recs_a), len(recs_b)) + 1
        first = FirstDifference(
            step, "length", None, f"A has {len(recs_a)} steps, B has {len(recs_b)}"
        )
    return DiffResult(
        compared,
        first,
        _config_of(a.header),
        _config_of(b.header),
        totals(recs_a),
        totals(recs_b),
    )


def _first_input_difference(ra: StepRecord, rb: StepRecord) -> Divergence | None:
    for i in range(max(len(ra.inputs), len(rb.inputs))):
        x = ra.inputs[i] if i < len(ra.inputs) else None
        y = rb.inputs[i] if i < len(rb.inputs) else None
        if x is not None and y is not None and encode(x) == encode(y):
            continue
        entity = ev.entity_of(x if x is not None else y)  # type: ignore[arg-type]
        return Divergence(
            ra.step,
            i,
            entity,
            _brief(x),
            _brief(y),
        )
    return None


def _brief(e: ev.Event | None) -> dict[str, object] | None:
    """An event as builtins, long arrays (prompts) cut to their first 8 items."""
    if e is None:
        return None
    out = to_builtins(e)
    for k, v in out.items():
        if isinstance(v, list) and len(v) > 8:
            out[k] = [*v[:8], f"... ({len(v)} items)"]
    return out


def format_diff(result: DiffResult, name_a: str, name_b: str) -> str:
    lines = []
    if result.first is None:
        lines.append(f"identical decisions over {result.steps_compared:,} steps")
    else:
        lines.append(result.first.describe())
    changes = result.config_changes()
    if changes:
        lines.append("config differences:")
        lines += [f"  {k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()]
    lines.append(f"  {'':<20}{'A':>16}{'B':>16}{'B - A':>16}")
    for key, a in result.totals_a.items():
        b = result.totals_b[key]
        fmt = "{:>16.4f}" if isinstance(a, float) or isinstance(b, float) else "{:>16,}"
        lines.append(f"  {key:<20}" + fmt.format(a) + fmt.format(b) + fmt.format(b - a))
    lines.append(f"A: {name_a}\nB: {name_b}")
    return "\n".join(lines)
