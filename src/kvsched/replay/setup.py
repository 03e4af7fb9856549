"""Setting up a replay: option checks, the scheduler config of a trace, sweeps, executors.

Everything here raises ``SetupError`` for a problem with what was asked (the command line
maps it to ``kvsched: error: ...`` and exit code 2); messages name the option at fault.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import attrs

from kvsched.config import (
    BLOCK_SIZE,
    CHECKPOINT_BUDGET,
    CHECKPOINT_POLICIES,
    PLACEMENTS,
    POLICY_ENGINE_SETTINGS,
    ModelSpec,
    SchedulerConfig,
)
from kvsched.engine import create_log
from kvsched.events.log import EventLog
from kvsched.gpu.sim import CostModel, SimulatedExecutor
from kvsched.headers import FLAT_OF
from kvsched.replay.driver import Executor
from kvsched.replay.shapes import ChatBranching, ShapeError, parse_params
from kvsched.replay.sharing import CodeEdit, sharing_model
from kvsched.replay.sweep_table import UNBOUNDED_BUDGET
from kvsched.replay.traces import Trace, TraceInfo, detect_format, log_config, read_trace
from kvsched.replay.workload import speed_up

TRACE_VOCAB = 150_000
"""The vocabulary of the synthetic prompts of Mooncake and Azure traces."""

SWEEP_KEYS = {
    "cache-blocks": "num_blocks",
    "block-size": "block_size",
    "max-batch": "max_batch",
    "max-prefill-tokens": "max_prefill_tokens",
    "checkpoint-budget": "checkpoint_budget",
    "checkpoint-memory": "checkpoint_memory",
}
"""Sweepable options (``--sweep KEY=...``) and the ``SchedulerConfig`` field each sets."""

_SIZES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``123``, ``64MiB``, ``20GiB``, ``1.5G`` as bytes; ValueError otherwise."""
    raw = text.strip().lower().replace("_", "")
    for suffix in ("ib", "b"):
        if raw.endswith(suffix):
            raw = raw[: -len(suffix)]
            break
    unit = raw[-1:] if raw[-1:] in _SIZES and raw[-1:] else ""
    number = raw[: len(raw) - len(unit)]
    value = float(number) * _SIZES[unit]
    if not value >= 0 or value != value or value > 1 << 50:
        raise ValueError(f"not a size: {text!r}")
    return int(value)


Sweep = tuple[str, list[int]]


class SetupError(ValueError):
    """A replay or demo that cannot be set up as asked; the message names the option."""


def parse_sweep(spec: str) -> Sweep:
    """``KEY=V1,V2,...`` (KEY one of ``SWEEP_KEYS``, positive integers; sizes for
    checkpoint-memory; ``unbounded`` for checkpoint-budget) as (KEY, values)."""
    key, sep, raw = spec.partition("=")
    key = key.strip()
    if not sep or key not in SWEEP_KEYS:
        raise SetupError(
            f"--sweep {spec!r}: expected KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}"
        )
    try:
        read = parse_size if key == "checkpoint-memory" else lambda v: int(v.replace("_", ""))
        values = [
            UNBOUNDED_BUDGET if key == "checkpoint-budget" and v.strip() == "unbounded" else read(v)
            for v in raw.split(",")
            if v.strip()
        ]
    except ValueError:
        raise SetupError(f"--sweep {spec!r}: values must be integers (or sizes)") from None
    if not values or min(values) <= 0:
        raise SetupError(f"--sweep {spec!r}: give one or more positive values")
    return key, values


def parse_sweeps(specs: str | Sequence[str]) -> tuple[Sweep, ...]:
    """One or more ``--sweep`` specs, each key at most once (a sweep may run checkpoint
    budgets and checkpoint memories side by side: each point sets one, the other resets)."""
    sweeps = tuple(parse_sweep(s) for s in ([specs] if isinstance(specs, str) else specs))
    keys = [k for k, _ in sweeps]
    if len(set(keys)) != len(keys):
        raise SetupError(f"--sweep: each key once (got {', '.join(keys)}); list its values")
    return sweeps


_RESETS: dict[str, dict[str, int]] = {
    "checkpoint-budget": {"checkpoint_memory": 0},
    "checkpoint-memory": {"checkpoint_budget": CHECKPOINT_BUDGET},
}
"""What a sweep point of a key resets: a budget point counts checkpoints (no memory), a
memory point leaves the count budget at its default (the config refuses both set)."""


def sweep_config(config: SchedulerConfig, key: str, value: int) -> SchedulerConfig:
    """``config`` with the sweep key ``key`` set to ``value`` (a checkpoint-memory point
    resets the count budget to its default, a budget point the memory to none)."""
    reset = _RESETS.get(key, {})
    try:
        return SchedulerConfig.from_dict({**config.to_dict(), **reset, SWEEP_KEYS[key]: value})
    except ValueError as exc:
        raise SetupError(f"--sweep {key}={value}: {exc}") from None


def torch_module() -> Any:
    """``kvsched.gpu.torch_executor``, or a SetupError saying how to install it."""
    try:
        return importlib.import_module("kvsched.gpu.torch_executor")
    except ImportError as exc:
        raise SetupError(
            f"--executor torch: the torch executor is not available ({exc}); "
            "install it with pip install 'kvsched[torch]' or use --executor sim"
        ) from None


def make_executor(
    kind: str, config: SchedulerConfig, cost: CostModel, model: str | None = None
) -> Executor:
    """The ``sim`` (cost model) or ``torch`` (checkpoint ``model``) executor for ``config``."""
    if kind == "sim":
        return SimulatedExecutor(config.model.vocab_size, cost)
    factory = getattr(torch_module(), "TorchExecutor", None)
    if factory is None:
        raise SetupError("--executor torch: kvsched.gpu.torch_executor has no TorchExecutor")
    if model is None:
        raise SetupError("--executor torch needs --model DIR (a checkpoint directory)")
    try:
        executor: Executor = factory(
            model, config.num_blocks, config.block_size, config.num_state_slots
        )
    except Exception as exc:  # a missing GPU, driver or weights: say so, exit 2
        raise SetupError(f"--executor torch: cannot start the torch executor: {exc}") from None
    return executor


def open_log(path: str | None, config: SchedulerConfig) -> EventLog | None:
    """A new event log at ``path`` for a run of ``config``; None without a path."""
    return create_log(path, config) if path else None


@attrs.frozen
class TraceReplay:
    """A trace read for ``kvsched replay`` with its checked options."""

    trace: Trace
    cost: CostModel
    sweep: Sweep | None = None  # the first --sweep (all of them: sweeps)
    executor: str = "sim"
    model: str | None = None
    speedup: float = 1.0
    policies: tuple[str, ...] = ()  # checkpoint policies to compare (one run each per point)
    sweeps: tuple[Sweep, ...] = ()  # every --sweep, in the order given

    def extra(self) -> dict[str, Any]:
        """What the metrics of each run add about the trace and the options."""
        info = self.trace.info
        return {
            "trace": info.path,
            "format": info.format,
            "trace_lines": info.lines,
            "bad_lines": len(info.bad_lines),
            "out_of_order": info.out_of_order,
            "ideal_hit_rate": info.ideal_hit_rate,
            "executor": self.executor,
            "speedup": self.speedup,
            "cost_model": self.cost.to_dict(),
        }


def load_trace_replay(
    path: str,
    *,
    executor: str = "sim",
    model: str | None = None,
    fmt: str | None = None,
    block_size: int | None = None,
    skip_bad_lines: bool = False,
    limit: int | None = None,
    speedup: float = 1.0,
    cost: str | None = None,
    sweep: str | Sequence[str] | None = None,
    log: str | None = None,
    policies: str | None = None,
    seed: int = 0,
    sharing: str | None = None,
    shape_params: str | None = None,
) -> TraceReplay:
    """Check the options (before reading anything where they allow) and read the trace.

    Raises SetupError for bad options and ``TraceError`` for a trace that cannot be read.
    """
    kind = detect_format(path, fmt)
    shape = trace_shape(kind, sharing, shape_params)
    try:
        cost_model = CostModel.parse(cost or "")
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    sweeps = parse_sweeps(sweep) if sweep else ()
    parsed = sweeps[0] if sweeps else None
    if parsed and log:
        raise SetupError("--log records one run: it cannot be combined with --sweep")
    compared = parse_policies(policies) if policies else ()
    if compared and log:
        raise SetupError("--log records one run: it cannot be combined with --policies")
    if executor == "torch":
        torch_module()  # fail before reading the trace
        if model is None:
            raise SetupError("--executor torch needs --model DIR (a checkpoint directory)")
    trace = read_trace(
        path,
        kind,
        block_size=block_size or 64,
        vocab_size=TRACE_VOCAB,
        skip_bad_lines=skip_bad_lines,
        limit=limit,
        seed=seed,
        shape=shape,
    )
    if speedup != 1.0:
        if not speedup > 0:
            raise SetupError(f"--speedup must be positive, got {speedup}")
        trace = attrs.evolve(trace, workload=speed_up(trace.workload, speedup))
    return TraceReplay(trace, cost_model, parsed, executor, model, speedup, compared, sweeps)


def trace_shape(
    kind: str, sharing: str | None, params: str | None
) -> ChatBranching | CodeEdit | None:
    """The parameters of a generated shape (``gen:NAME``) or of an Azure trace's sharing
    model (``--sharing``), from ``--shape-param``; SetupError names the option at fault."""
    if sharing is not None and kind != "azure":
        raise SetupError(f"--sharing {sharing}: a sharing model applies to Azure traces only")
    if params and kind not in ("gen", "azure"):
        raise SetupError("--shape-param: only a gen:NAME shape or --sharing has parameters")
    if params and kind == "azure" and sharing is None:
        raise SetupError("--shape-param sets a sharing model's parameters: give --sharing")
    try:
        if kind == "gen":
            gen: ChatBranching = parse_params(ChatBranching, params, vocab_size=TRACE_VOCAB)
            return gen
        if kind == "azure" and sharing is not None:
            return sharing_model(sharing, params, TRACE_VOCAB)
    except ShapeError as exc:
        option = "--sharing" if str(exc).startswith("--sharing") else "--shape-param"
        raise SetupError(f"{option}: {exc}" if option == "--shape-param" else str(exc)) from None
    return None


ORACLE = "oracle"
"""The upper reference (it knows the trace's future): every comparison of policies runs it."""


def parse_policies(spec: str) -> tuple[str, ...]:
    """``kvsched,lmdeploy`` or ``all`` as checkpoint policy names (CHECKPOINT_POLICIES); the
    oracle joins every comparison (last, unless named), so each table and plot shows the
    online policies beside the upper reference."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if names == ["all"]:
        return tuple(CHECKPOINT_POLICIES)
    unknown = [n for n in names if n not in CHECKPOINT_POLICIES]
    if unknown or not names or len(set(names)) != len(names):
        raise SetupError(
            f"--policies {spec!r}: give distinct names of {', '.join(CHECKPOINT_POLICIES)}, or all"
        )
    return tuple(names) if ORACLE in names else (*names, ORACLE)


def checkpoint_fields(
    *,
    budget: int | None = None,
    memory: str | None = None,
    policy: str | None = None,
    placement: str | None = None,
    eviction: str | None = None,
    interval: int | None = None,
) -> dict[str, Any]:
    """The ``SchedulerConfig`` fields the checkpoint options set (SetupError names the
    option at fault)."""
    fields: dict[str, Any] = {}
    if policy is not None:
        if policy not in CHECKPOINT_POLICIES:
            known = ", ".join(CHECKPOINT_POLICIES)
            raise SetupError(f"--checkpoint-policy {policy!r}: not one of {known}")
        preset = CHECKPOINT_POLICIES[policy]
        fields.update({FLAT_OF["checkpoints", k]: v for k, v in preset.items()})
        fields.update(POLICY_ENGINE_SETTINGS.get(policy, {}))  # (caching at planning)
    if placement is not None:
        rules = tuple(r.strip() for r in placement.split(",") if r.strip())
        unknown = sorted(set(rules) - set(PLACEMENTS))
        if unknown:
            raise SetupError(
                f"--checkpoint-placement: unknown rules {unknown}; known: {', '.join(PLACEMENTS)}"
            )
        fields["checkpoint_placement"] = rules
    if eviction is not None:
        fields["checkpoint_eviction"] = eviction
    for option, name, value in (
        ("--checkpoint-budget", "checkpoint_budget", budget),
        ("--checkpoint-interval", "checkpoint_interval", interval),
    ):
        if value is not None:
            if value < (0 if name == "checkpoint_budget" else 1):
                raise SetupError(f"{option} must be {'>= 0' if value < 0 else '>= 1'}, got {value}")
            fields[name] = value
    if memory is not None:
        try:
            fields["checkpoint_memory"] = parse_size(memory)
        except ValueError:
            raise SetupError(f"--checkpoint-memory {memory!r}: not a size (e.g. 20GiB)") from None
    return fields


def unbounded_blocks(info: TraceInfo, requests: int, block_size: int) -> int:
    """Enough blocks that nothing is ever evicted: every request's prompt and output in
    blocks of its own (an upper bound on the distinct blocks of the whole trace)."""
    return info.total_tokens // block_size + 2 * requests + 2


def trace_config(
    trace: Trace,
    *,
    block_size: int | None = None,
    cache_blocks: int | None = None,
    max_batch: int | None = None,
    max_prefill_tokens: int | None = None,
    order: str | None = None,
    hybrid: bool = False,
    turns: dict[str, Any] | None = None,
    checkpoints: dict[str, Any] | None = None,
) -> SchedulerConfig:
    """The scheduler config to replay ``trace`` with: a kvsched event log's header config
    (else the defaults with the trace vocabulary), a context that fits the longest request,
    an unbounded cache unless ``cache_blocks`` is given, then the options that are given."""
    base: dict[str, Any] = {}
    if trace.info.format == "log":
        base = log_config(trace.info.path)
    model = dict(base.get("model", {}))
    if trace.info.format != "log":
        model["vocab_size"] = TRACE_VOCAB
    longest = trace.info.max_request_tokens + 1
    context = int(model.get("max_context", ModelSpec().max_context))
    while context < longest:
        context *= 2
    model["max_context"] = context
    block = block_size or int(base.get("block_size", BLOCK_SIZE))
    if cache_blocks is None:
        cache_blocks = unbounded_blocks(trace.info, trace.info.requests, block)
    fields = {
        **{k: v for k, v in base.items() if k not in ("model", "legacy")},
        "model": ModelSpec(**model),
        "block_size": block,
        "num_blocks": cache_blocks,
    }
    given = {"max_batch": max_batch, "max_prefill_tokens": max_prefill_tokens, "order": order}
    given.update(turns or {})
    fields.update({k: v for k, v in given.items() if v is not None})
    if hybrid:
        fields["hybrid"] = True
    fields.update(checkpoints or {})
    try:
        return SchedulerConfig.from_dict(fields)
    except (TypeError, ValueError) as exc:
        raise SetupError(f"bad configuration: {exc}") from None
