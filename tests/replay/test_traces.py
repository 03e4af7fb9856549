"""Trace readers: Mooncake JSONL, Azure CSV and kvsched event logs become deterministic
workloads; malformed input is an error naming file and line (or is counted and skipped)."""

from __future__ import annotations

import contextlib
import itertools
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvsched.cli
import kvsched.events.log
from kvsched.replay.traces import (
    MAX_HASH_ID,
    MAX_HASH_IDS,
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_TIMESTAMP_MS,
    MOONCAKE_BLOCK,
    TraceError,
    detect_format,
    log_config,
    read_azure,
    read_log_trace,
    read_mooncake,
    read_trace,
    sequential_ideal,
    synth_tokens,
)

TRACES = Path(__file__).parents[2].parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_fast25_synthetic_trace.jsonl"
AZURE = TRACES / "azure2023_AzureLLMInferenceTrace_code.csv"


def needs(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"shared trace {path} is missing (expected next to the repository)")


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def req(ts: int, n_in: int, ids: list[int], n_out: int = 4) -> dict[str, object]:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for row in f:
            if row.startswith("VmSize:"):
                return int(row.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def peak_bytes(cap: int = 1 << 30) -> Iterator[list[int]]:
    """Yields a list that holds, after the block, the peak bytes traced during it; the
    address space may grow by at most ``cap`` meanwhile (where the platform allows), so a
    regression is a MemoryError, not a machine out of memory."""
    peak: list[int] = []
    limit: tuple[int, int] | None = None
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + cap, limit[1]))
    except (ImportError, OSError, ValueError):
        limit = None
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, limit)


# ------------------------------------------------------------------------ Mooncake


def test_mooncake_requests_share_exactly_the_prompt_prefix_their_hash_ids_share(tmp_path: Path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [req(0, 1500, [0, 1, 2]), req(5, 1300, [0, 1, 3]), req(9, 700, [4, 5])],
    )

    turns = read_mooncake(path).workload.turns

    a, b, c = (np.asarray(t.request.prompt) for t in turns)
    assert (len(a), len(b), len(c)) == (1500, 1300, 700)
    assert np.array_equal(a[: 2 * MOONCAKE_BLOCK], b[: 2 * MOONCAKE_BLOCK])
    assert a[2 * MOONCAKE_BLOCK] != b[2 * MOONCAKE_BLOCK]
    assert not np.array_equal(a[:MOONCAKE_BLOCK], c[:MOONCAKE_BLOCK])


def test_mooncake_partial_last_block_is_identical_wherever_its_id_appears(tmp_path: Path):
    path = write_jsonl(tmp_path / "t.jsonl", [req(0, 800, [0, 1]), req(3, 800, [0, 1])])

    a, b = (np.asarray(t.request.prompt) for t in read_mooncake(path).workload.turns)

    assert np.array_equal(a, b)


def test_mooncake_id_with_two_different_tail_lengths_is_an_error_naming_both_lines(
    tmp_path: Path,
):
    path = write_jsonl(tmp_path / "t.jsonl", [req(0, 800, [0, 1]), req(3, 900, [0, 1])])

    with pytest.raises(TraceError, match=r"t\.jsonl:2: hash id 1 covers 388 tokens .* line 1"):
        read_mooncake(path)


def test_mooncake_tokens_are_the_same_in_every_read_and_inside_the_vocabulary(tmp_path: Path):
    path = write_jsonl(tmp_path / "t.jsonl", [req(0, 3000, list(range(6)))])

    first = read_mooncake(path, vocab_size=1000).workload.turns[0].request.prompt
    again = read_mooncake(path, vocab_size=1000).workload.turns[0].request.prompt

    assert np.array_equal(first, again)
    assert first.min() >= 1 and first.max() < 1000


@pytest.mark.parametrize("big", [3_000_000, 10**9, MAX_HASH_ID])
def test_a_large_mooncake_hash_id_costs_the_memory_of_the_ids_used_not_a_table_up_to_it(
    tmp_path: Path, big: int
):
    path = write_jsonl(tmp_path / "t.jsonl", [req(0, 10, [0]), req(1, 600, [1, big])])

    with peak_bytes() as peak:
        turns = read_mooncake(path).workload.turns

    assert peak[0] < 1 << 20  # three ids of 512 tokens: 6 KiB of tokens
    prompt = np.asarray(turns[1].request.prompt)
    expected = synth_tokens(np.asarray([1, big], dtype=np.uint64), MOONCAKE_BLOCK, 150_000)
    assert np.array_equal(prompt, expected.reshape(-1)[:600])


def test_mooncake_block_tokens_are_those_of_a_table_of_every_id_up_to_the_largest(
    tmp_path: Path,
):
    ids = [7, 3, 1000, 3]
    path = write_jsonl(tmp_path / "t.jsonl", [req(0, 4 * MOONCAKE_BLOCK - 5, ids)])

    prompt = read_mooncake(path, vocab_size=5000, seed=3).workload.turns[0].request.prompt

    table = synth_tokens(np.arange(1001), MOONCAKE_BLOCK, 5000, 3)
    assert np.array_equal(prompt, table[ids].reshape(-1)[: 4 * MOONCAKE_BLOCK - 5])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (req(0, 10, [0], n_out=10**12), "'output_length' must be <= 1,048,576"),
        (req(0, 10, [0], n_out=MAX_OUTPUT_TOKENS + 1), "'output_length' must be <= 1,048,576"),
        (req(0, MAX_PROMPT_TOKENS + 1, [0] * (MAX_HASH_IDS + 1)), "'input_length' must be <="),
        (req(0, 10**12, [0]), "'input_length' must be <= 1,048,576"),
        (req(MAX_TIMESTAMP_MS + 1, 10, [0]), "'timestamp' must be <= 1,000,000,000,000"),
        (req(10**400, 10, [0]), "limit), got a 1329-bit integer"),
        (req(0, 10, [MAX_HASH_ID + 1]), "up to 2**63 - 1, got 9223372036854775808 at index 0"),
        (req(0, 10, [0] * (MAX_HASH_IDS + 1)), "2,049 hash ids: at most 2,048"),
        ("[" * 100_000, "malformed JSON (nested too deeply)"),
        ('{"timestamp": ' + "7" * 5000 + "}", "a number of more than 4300 digits"),
    ],
    ids=[
        "output_1e12",
        "output_limit+1",
        "input_limit+1",
        "input_1e12",
        "timestamp_limit+1",
        "timestamp_1e400",
        "hash_id_2**63",
        "hash_ids_2049",
        "nested_json",
        "5000_digits",
    ],
)
def test_mooncake_value_past_a_documented_limit_is_an_error_naming_file_and_line(
    tmp_path: Path, row: object, message: str
):
    path = write_jsonl(tmp_path / "big.jsonl", [req(0, 10, [0]), row])

    with peak_bytes() as peak, pytest.raises(TraceError) as info:
        read_mooncake(path)

    assert str(info.value).startswith(f"{path}:2: ") and message in str(info.value)
    assert peak[0] < 16 << 20  # the parsed line, never its tokens


def test_mooncake_values_at_the_limits_are_read(tmp_path: Path):
    ids = list(range(MAX_HASH_ID - MAX_HASH_IDS + 1, MAX_HASH_ID + 1))
    path = write_jsonl(
        tmp_path / "t.jsonl", [req(MAX_TIMESTAMP_MS, MAX_PROMPT_TOKENS, ids, MAX_OUTPUT_TOKENS)]
    )

    trace = read_mooncake(path)

    (turn,) = trace.workload.turns
    assert len(turn.request.prompt) == MAX_PROMPT_TOKENS
    assert turn.request.max_tokens == MAX_OUTPUT_TOKENS
    assert turn.arrival_s == MAX_TIMESTAMP_MS / 1000


def test_replay_of_an_output_length_past_the_limit_is_a_kvsched_error_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = write_jsonl(tmp_path / "t.jsonl", [req(0, 10, [0], n_out=10**12)])

    code = kvsched.cli.main(["replay", str(path), "--json", "--quiet"])

    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"kvsched: error: {path}:1: field 'output_length' must be <= ")


def test_a_line_that_is_not_utf8_is_an_error_naming_its_line(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    path.write_bytes((json.dumps(req(0, 10, [0])) + "\n").encode() * 2 + b"\xff\xfe\n")

    with pytest.raises(TraceError, match=r"t\.jsonl:3: not UTF-8 text"):
        read_mooncake(path)


def test_unsorted_timestamps_are_replayed_in_timestamp_then_line_order(tmp_path: Path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [req(30, 10, [0]), req(10, 20, [1]), req(30, 30, [2]), req(10, 40, [3])],
    )

    trace = read_mooncake(path)

    lengths = [len(t.request.prompt) for t in trace.workload.turns]
    assert lengths == [20, 40, 10, 30]
    assert [t.arrival_s for t in trace.workload.turns] == [0.01, 0.01, 0.03, 0.03]
    assert [t.request.seq_id for t in trace.workload.turns] == [0, 1, 2, 3]
    assert trace.info.out_of_order == 2  # lines 2 and 4 are earlier than the line before


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 0, "input_length": 10,', "malformed JSON"),
        ({"timestamp": 0, "output_length": 3, "hash_ids": [0]}, "missing field 'input_length'"),
        ({"timestamp": 0, "input_length": 10, "output_length": 3}, "missing field 'hash_ids'"),
        (req(0, -5, []), "'input_length' must be >= 1, got -5"),
        (req(0, 10, [0], n_out=-1), "'output_length' must be >= 1, got -1"),
        (req(-1, 10, [0]), "'timestamp' must be >= 0"),
        (req(0, 10, [0, 1]), "2 hash ids for input_length 10"),
        (req(0, 10, ["x"]), "'hash_ids' must be a list of non-negative integers"),
        ({"timestamp": 0.5, "input_length": 10, "output_length": 3, "hash_ids": [0]}, "integer"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_mooncake_line_is_an_error_naming_file_and_line(
    tmp_path: Path, line: object, message: str
):
    path = write_jsonl(tmp_path / "bad.jsonl", [req(0, 10, [0]), line, req(2, 10, [0])])

    with pytest.raises(TraceError) as info:
        read_mooncake(path)

    assert str(info.value).startswith(f"{path}:2: ")
    assert message in str(info.value)


def test_skip_bad_lines_counts_and_reports_them_and_keeps_the_good_requests(tmp_path: Path):
    path = write_jsonl(
        tmp_path / "bad.jsonl", [req(0, 10, [0]), "{oops", req(1, -3, []), req(2, 10, [0])]
    )

    trace = read_mooncake(path, skip_bad_lines=True)

    assert trace.info.requests == 2 and trace.info.lines == 4
    assert [b.line for b in trace.info.bad_lines] == [2, 3]
    assert "malformed JSON" in trace.info.bad_lines[0].reason
    assert trace.info.as_dict()["bad_lines"] == 2


def test_unknown_trace_format_is_an_error_for_a_name_and_for_a_suffix(tmp_path: Path):
    with pytest.raises(TraceError, match="unknown trace format 'parquet'"):
        detect_format(tmp_path / "t.jsonl", "parquet")
    with pytest.raises(TraceError, match=r"unknown trace format \(suffix '.txt'\)"):
        read_trace(tmp_path / "t.txt")


def test_missing_trace_file_is_an_error_naming_it(tmp_path: Path):
    with pytest.raises(TraceError, match="no such trace file"):
        read_mooncake(tmp_path / "missing.jsonl")


def test_sequential_ideal_hits_earlier_blocks_whole_blocks_only_never_the_last_token():
    ids = [[0, 1], [0, 1], [0, 2]]
    lengths = [1024, 1024, 600]

    # second: all 1024 cached but the last token is recomputed -> 960 at block size 64;
    # third: block 0 (512 tokens) cached.
    assert sequential_ideal(ids, lengths, 64) == pytest.approx((960 + 512) / 2648)
    assert sequential_ideal(ids, lengths, 512) == pytest.approx((512 + 512) / 2648)


def test_whole_mooncake_trace_sequential_ideal_is_65_1_percent():
    needs(MOONCAKE)
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]

    ideal = sequential_ideal([r["hash_ids"] for r in rows], [r["input_length"] for r in rows], 64)

    assert len(rows) == 3993
    assert ideal == pytest.approx(0.651, abs=0.0005)


def test_first_200_mooncake_requests_read_in_order_with_their_lengths():
    needs(MOONCAKE)

    trace = read_mooncake(MOONCAKE, limit=200)

    turns = trace.workload.turns
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    assert trace.info.requests == 200 and not trace.info.bad_lines
    assert len(turns[0].request.prompt) == first["input_length"]
    assert turns[0].request.max_tokens == first["output_length"]
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(turns))


# --------------------------------------------------------------------------- Azure


def test_azure_timestamps_keep_seven_fractional_digits(tmp_path: Path):
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:03.9799601,100,2\n"
        "2023-11-16 18:17:05.0000000,7,1\n"
    )

    turns = read_azure(path).workload.turns

    assert [t.arrival_s for t in turns] == pytest.approx([0.0, 1e-7, 1.02004], abs=1e-9)
    assert [len(t.request.prompt) for t in turns] == [4808, 100, 7]
    assert not np.array_equal(turns[1].request.prompt[:7], turns[2].request.prompt)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("2023-11-16 18:17:04.1,-3,2", "'ContextTokens' must be >= 1, got -3"),
        ("2023-11-16 18:17:04.1,12", "expected 3 fields, got 2"),
        ("yesterday,12,3", "bad timestamp"),
        ("2023-11-16 18:17:04.1,12,x", "'GeneratedTokens' must be an integer"),
    ],
)
def test_malformed_azure_line_is_an_error_naming_file_and_line(
    tmp_path: Path, line: str, message: str
):
    path = tmp_path / "a.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,5,1\n{line}\n")

    with pytest.raises(TraceError) as info:
        read_azure(path)

    assert str(info.value).startswith(f"{path}:3: ") and message in str(info.value)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("2023-11-16 18:17:04.1,1000000000000,2", "'ContextTokens' must be <= 1,048,576"),
        (f"2023-11-16 18:17:04.1,{MAX_PROMPT_TOKENS + 1},2", "'ContextTokens' must be <="),
        ("2023-11-16 18:17:04.1,5,1000000000000", "'GeneratedTokens' must be <= 1,048,576"),
        ("2023-11-16 18:17:04.1,5," + "9" * 5000, "limit), got a 5000-digit number"),
        ("2023-11-16 18:17:04.1,5," + "1" * 200_000, "field larger than field limit"),
    ],
    ids=["context_1e12", "context_limit+1", "generated_1e12", "5000_digits", "200k_field"],
)
def test_azure_value_past_a_documented_limit_is_an_error_naming_file_and_line(
    tmp_path: Path, line: str, message: str
):
    path = tmp_path / "a.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,5,1\n{line}\n")

    with peak_bytes() as peak, pytest.raises(TraceError) as info:
        read_azure(path)

    assert str(info.value).startswith(f"{path}:3: ") and message in str(info.value)
    assert len(str(info.value)) < 200 + len(str(path))  # a long value is shortened
    assert peak[0] < 16 << 20


def test_azure_values_at_the_limits_are_read(tmp_path: Path):
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        f"2023-11-16 18:17:03.1,{MAX_PROMPT_TOKENS},{MAX_OUTPUT_TOKENS}\n"
    )

    (turn,) = read_azure(path).workload.turns

    assert len(turn.request.prompt) == MAX_PROMPT_TOKENS
    assert turn.request.max_tokens == MAX_OUTPUT_TOKENS


def test_azure_trace_head_reads_with_relative_arrivals():
    needs(AZURE)

    trace = read_azure(AZURE, limit=50)

    turns = trace.workload.turns
    assert trace.info.requests == 50 and turns[0].arrival_s == 0.0
    assert turns[1].arrival_s == pytest.approx(0.052, abs=1e-9)
    assert len(turns[0].request.prompt) == 4808 and turns[0].request.max_tokens == 10


# ----------------------------------------------------------------------- event log


def test_event_log_trace_replays_the_logged_arrivals_at_their_logged_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    log = tmp_path / "demo.kvlog"
    assert (
        kvsched.cli.main(["demo", "--sessions", "3", "--turns", "2", "--quiet", "--log", str(log)])
        == 0
    )
    capsys.readouterr()

    trace = read_log_trace(log)

    assert trace.info.requests == 6
    assert sorted(t.request.seq_id for t in trace.workload.turns) == list(range(6))
    assert all(t.arrival_s == t.request.arrival_time for t in trace.workload.turns)


def test_an_event_log_trace_is_read_one_record_at_a_time_not_the_whole_log_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    log = tmp_path / "demo.kvlog"
    demo = ["demo", "--sessions", "3", "--turns", "2", "--quiet", "--log", str(log)]
    assert kvsched.cli.main(demo) == 0
    capsys.readouterr()

    def whole_log(path: object) -> None:
        raise AssertionError("the whole log was read into memory")

    monkeypatch.setattr(kvsched.events.log, "read_log", whole_log)
    monkeypatch.setattr(kvsched.events.log.LogReader, "read_all", whole_log)

    assert read_log_trace(log).info.requests == 6
    assert log_config(log)["block_size"] > 0
