"""Fuzz of the trace readers: random Mooncake and Azure lines (valid, near-valid, huge,
negative, garbage, missing fields, huge hash ids) end either in a workload that replays or in
``kvsched: error: FILE:LINE: reason`` (exit 2), and reading never takes more memory than a
bound linear in the file's bytes and the prompt tokens it describes.

The bound, ``C0 + C1 * bytes + C2 * prompt tokens`` (tracemalloc peak, numpy included):

* ``C2 = 64`` bytes per prompt token: the prompt itself (int32, 4 B), its hash id's cached
  block (4 B per token of a full 512-token id) and the transient uint64 arrays of
  ``synth_tokens`` for the request being synthesised (a few x 8 B per token). Measured: 20 B
  per token for one 2**20-token request of 2,048 distinct ids.
* ``C1 = 64`` bytes per input byte: the Python objects of the parsed lines (a request's row,
  ``Turn`` and ``RequestArrived``, about 1 KiB for a line of at least 23 bytes) and the 2 KiB
  block of each distinct partial tail id (at most one per line of at least 60 bytes).
  Measured: 42 B per byte for 20,000 one-token lines, each with its own id (the worst shape
  found); 23 B per byte for 20,000 one-token Azure lines.
* ``C0 = 1 MiB``: one-off caches (``strptime``'s compiled format, csv and json state) and the
  synthesis temporaries of a single block.

Before the reader's limits and its map of the hash ids that occur, one id of 3,000,000 asked
for 11.4 GiB and a ContextTokens of 10**12 for 7.28 TiB.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import re
from pathlib import Path

import pytest
from hypothesis import event, given, target
from hypothesis import strategies as st
from tests.replay.test_traces import peak_bytes

import kvsched.cli
from kvsched.engine import Engine
from kvsched.gpu.sim import CostModel
from kvsched.replay.driver import run
from kvsched.replay.setup import make_executor, trace_config
from kvsched.replay.traces import (
    AZURE_COLUMNS,
    MAX_HASH_ID,
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_TIMESTAMP_MS,
    MOONCAKE_BLOCK,
    Trace,
    TraceError,
    read_trace,
)

C0 = 1 << 20
C1 = 64
C2 = 64

HUGE = [
    0,
    -1,
    -(10**12),
    MAX_PROMPT_TOKENS,
    MAX_PROMPT_TOKENS + 1,
    MAX_OUTPUT_TOKENS + 1,
    MAX_TIMESTAMP_MS + 1,
    3_000_000,
    10**9,
    10**12,
    MAX_HASH_ID,
    MAX_HASH_ID + 1,
    2**64,
    10**100,
]
ODD = st.one_of(
    st.sampled_from(HUGE),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.lists(st.integers(0, 5), max_size=3),
)
KINDS = ["valid", "valid", "valid", "odd", "drop", "cut", "garbage", "huge"]
TEXT = st.text(max_size=60)


@st.composite
def mooncake_line(draw: st.DrawFn) -> str:
    n_in = draw(st.integers(1, 2000))
    k = (n_in - 1) // MOONCAKE_BLOCK
    full = draw(st.lists(st.integers(0, 40), min_size=k, max_size=k))
    tail = draw(st.one_of(st.integers(0, 40), st.integers(10**6, 10**7), st.sampled_from(HUGE)))
    row: dict[str, object] = {
        "timestamp": draw(st.integers(0, 5000)),
        "input_length": n_in,
        "output_length": draw(st.integers(1, 6)),
        "hash_ids": [*full, tail],
    }
    kind = draw(st.sampled_from(KINDS))
    if kind == "odd":
        row[draw(st.sampled_from(sorted(row)))] = draw(ODD)
    elif kind == "drop":
        del row[draw(st.sampled_from(sorted(row)))]
    elif kind == "huge":
        field = draw(st.sampled_from(sorted(row)))
        row[field] = draw(st.sampled_from(HUGE))
        if field == "hash_ids":
            row[field] = [draw(st.sampled_from(HUGE))] * draw(st.sampled_from([1, 2, 2049]))
    elif kind == "garbage":
        return draw(TEXT)
    text = json.dumps(row)
    return text[: draw(st.integers(0, len(text) - 1))] if kind == "cut" else text


@st.composite
def azure_line(draw: st.DrawFn) -> str:
    start = dt.datetime(2023, 11, 16)
    at = draw(st.datetimes(min_value=start, max_value=start + dt.timedelta(hours=1)))
    fields = [
        f"{at:%Y-%m-%d %H:%M:%S}.{draw(st.integers(0, 9_999_999)):07d}",
        str(draw(st.integers(1, 2000))),
        str(draw(st.integers(1, 6))),
    ]
    kind = draw(st.sampled_from(KINDS))
    index = draw(st.integers(1 if kind == "huge" else 0, 2))
    if kind in ("odd", "huge"):
        fields[index] = str(draw(st.sampled_from(HUGE) if kind == "huge" else ODD))
    elif kind == "drop":
        del fields[index]
    elif kind == "garbage":
        return draw(TEXT)
    text = ",".join(fields)
    return text[: draw(st.integers(0, len(text) - 1))] if kind == "cut" else text


def read_measured(path: Path, skip: bool) -> tuple[Trace | TraceError, int]:
    """The trace or its error, and the peak bytes allocated reading it (a regression is a
    MemoryError past 1 GiB more address space, not a machine out of memory)."""
    outcome: Trace | TraceError
    with peak_bytes() as peak:
        try:
            outcome = read_trace(path, skip_bad_lines=skip)
        except TraceError as exc:
            outcome = exc
    return outcome, peak[0]


def check_outcome(path: Path, skip: bool) -> None:
    """Reading ``path`` stays within the bound and ends in a short replay or an error that
    the CLI prints as ``kvsched: error: FILE:LINE: reason`` with exit 2."""
    body = path.read_bytes()
    outcome, peak = read_measured(path, skip)
    turns = () if isinstance(outcome, TraceError) else outcome.workload.turns
    prompt = sum(len(t.request.prompt) for t in turns)
    bound = C0 + C1 * len(body) + C2 * prompt
    target(peak / bound, label="peak / bound")
    assert peak <= bound, (peak, len(body), prompt)
    event("error" if isinstance(outcome, TraceError) else "replayed")
    if isinstance(outcome, TraceError):
        message = str(outcome)
        lines = body.count(b"\n") + 1
        found = re.match(rf"{re.escape(str(path))}:(\d+): \S", message)
        assert found or message == f"{path}: no requests in the trace", message
        assert found is None or 1 <= int(found.group(1)) <= lines
        err = io.StringIO()
        args = ["replay", str(path), "--json", "--quiet"] + ["--skip-bad-lines"] * skip
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert kvsched.cli.main(args) == 2
        assert err.getvalue().startswith(f"kvsched: error: {message}\n")
        return
    config = trace_config(outcome)
    engine = Engine(config, check_invariants=True)
    executor = make_executor("sim", config, CostModel())
    summary = run(engine, executor, outcome.workload, max_steps=300)
    assert summary.finished + summary.rejected + summary.aborted <= outcome.info.requests


@given(lines=st.lists(mooncake_line(), min_size=1, max_size=8), skip=st.booleans())
def test_random_mooncake_lines_replay_or_fail_naming_file_and_line_in_bounded_memory(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str], skip: bool
) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "t.jsonl"
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")

    check_outcome(path, skip)


@given(
    lines=st.lists(azure_line(), min_size=1, max_size=8),
    header=st.sampled_from([",".join(AZURE_COLUMNS)] * 3 + ["TIMESTAMP,ContextTokens"]) | TEXT,
    skip=st.booleans(),
)
def test_random_azure_lines_replay_or_fail_naming_file_and_line_in_bounded_memory(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str], header: str, skip: bool
) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "t.csv"
    path.write_text("".join(f"{line}\n" for line in [header, *lines]), encoding="utf-8")

    check_outcome(path, skip)


def _mooncake_rows(rows: list[tuple[int, int, list[int]]]) -> str:
    return "".join(
        json.dumps({"timestamp": 0, "input_length": n, "output_length": o, "hash_ids": ids}) + "\n"
        for n, o, ids in rows
    )


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("t.jsonl", _mooncake_rows([(1, 1, [i]) for i in range(2000)])),
        ("t.jsonl", _mooncake_rows([(1, 1, [MAX_HASH_ID - i]) for i in range(2000)])),
        ("t.jsonl", _mooncake_rows([(MAX_PROMPT_TOKENS, 1, list(range(2048)))])),
        ("t.csv", ",".join(AZURE_COLUMNS) + "\n" + "2023-11-16 18:17:03.1,1,1\n" * 2000),
        ("t.csv", ",".join(AZURE_COLUMNS) + f"\n2023-11-16 18:17:03.1,{MAX_PROMPT_TOKENS},1\n" * 4),
    ],
    ids=["2000_one_token_ids", "2000_huge_ids", "2048_ids_2**20_tokens", "2000_azure", "4x2**20"],
)
def test_the_worst_trace_shapes_found_stay_within_the_memory_bound(
    tmp_path: Path, name: str, text: str
) -> None:
    path = tmp_path / name
    path.write_text(text)

    trace, peak = read_measured(path, skip=False)

    assert isinstance(trace, Trace)
    prompt = sum(len(t.request.prompt) for t in trace.workload.turns)
    assert peak <= C0 + C1 * len(text) + C2 * prompt
