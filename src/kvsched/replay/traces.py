"""Trace readers: Mooncake JSONL, Azure CSV and kvsched event logs, each into a ``Workload``.

* **Mooncake** (``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``): each
  hash id stands for a 512-token block *including everything before it*. Its tokens are
  synthesised by a counter-based PRNG keyed by the id (token j of id x is a function of
  (x, j) only), so two requests share exactly the prompt prefix their ids share, and a partial
  last block is the first ``tail`` tokens of its id's stream (the trace guarantees a partial id
  always has the same tail length; the reader checks it). The scheduler re-blocks the tokens
  at its own block size when it hashes them.
* **Azure** (``TIMESTAMP,ContextTokens,GeneratedTokens`` with 7 fractional digits): no prefix
  identity; every request gets its own tokens (keyed by its line), so nothing is shared.
  With ``sharing`` (``--sharing code-edit``, ``replay/sharing.py``), an explicit, seeded
  model of code-completion traffic assigns the tokens instead; arrivals and lengths are kept.
* **log**: the ``RequestArrived`` inputs of a kvsched event log, at their logged times.
* **gen** (``gen:NAME``, no file): a built-in generated shape (``replay/shapes.py``), seeded.

Arrivals are ordered by (timestamp, line), so a replay is deterministic whatever the file's
order. A malformed line raises ``TraceError`` naming the file and line; with
``skip_bad_lines=True`` it is counted (``TraceInfo.bad_lines``) and left out instead.

Memory follows what the trace describes, never the size of a number in it: the reader holds
each line's parsed fields, the prompt tokens of its requests (4 bytes each) and, for Mooncake,
the 512 tokens of each hash id that occurs (synthesised on first use, whatever its value).
Values past these limits are malformed lines, rejected before anything is synthesised:

* ``input_length`` / ``ContextTokens`` at most ``MAX_PROMPT_TOKENS`` (2**20 = 1,048,576);
* ``output_length`` / ``GeneratedTokens`` at most ``MAX_OUTPUT_TOKENS`` (2**20);
* ``hash_ids`` at most ``MAX_HASH_IDS`` per line (2,048 = ceil(2**20 / 512)), each id in
  [0, ``MAX_HASH_ID``] (2**63 - 1: ids key the token generator as unsigned 64-bit integers);
* a Mooncake ``timestamp`` at most ``MAX_TIMESTAMP_MS`` (10**12 ms, about 31.7 years).
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

import attrs
import numpy as np

from kvsched.events import types as ev
from kvsched.replay.shapes import ChatBranching, token_ideal
from kvsched.replay.sharing import CodeEdit, code_edit_prompts
from kvsched.replay.synth import MOONCAKE_BLOCK, BlockTokens, sequential_ideal, synth_tokens
from kvsched.replay.workload import Turn, Workload

TraceFormat = Literal["mooncake", "azure", "log", "gen"]
FORMATS: tuple[str, ...] = ("mooncake", "azure", "log")
MAX_PROMPT_TOKENS = 1 << 20
MAX_OUTPUT_TOKENS = 1 << 20
MAX_HASH_IDS = -(-MAX_PROMPT_TOKENS // MOONCAKE_BLOCK)
MAX_HASH_ID = (1 << 63) - 1
MAX_TIMESTAMP_MS = 10**12
_SUFFIXES = {".jsonl": "mooncake", ".csv": "azure", ".kvlog": "log"}
GEN_PREFIX = "gen:"  # a TRACE named gen:NAME is a built-in generated shape, not a file


class TraceError(ValueError):
    """A trace that cannot be read: names the file and, for a bad line, the line number."""


@attrs.frozen
class BadLine:
    line: int
    reason: str


@attrs.frozen
class TraceInfo:
    path: str
    format: str
    lines: int  # data lines read (bad ones included)
    requests: int
    bad_lines: tuple[BadLine, ...] = ()
    out_of_order: int = 0  # lines whose timestamp is earlier than the line before
    max_request_tokens: int = 0  # longest prompt + output
    total_tokens: int = 0  # sum of prompt + output over the trace
    ideal_hit_rate: float | None = None  # sequential, infinite cache, scheduler block size

    def as_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["bad_lines"] = len(self.bad_lines)
        out["bad_line_samples"] = [f"line {b.line}: {b.reason}" for b in self.bad_lines[:10]]
        return out


@attrs.frozen
class Trace:
    workload: Workload
    info: TraceInfo


def detect_format(path: str | Path, fmt: str | None = None) -> str:
    """The trace format: ``fmt`` when given (checked), else "gen" for ``gen:NAME``, else from
    the file's suffix."""
    if str(path).startswith(GEN_PREFIX):
        if fmt not in (None, "gen"):
            raise TraceError(f"{path}: a generated shape has no --format (drop it)")
        return "gen"
    if fmt is not None:
        if fmt not in FORMATS:
            raise TraceError(f"{path}: unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
        return fmt
    found = _SUFFIXES.get(Path(path).suffix.lower())
    if found is None:
        raise TraceError(
            f"{path}: unknown trace format (suffix {Path(path).suffix or 'none'!r}); "
            f"pass --format {'|'.join(FORMATS)}"
        )
    return found


def read_trace(
    path: str | Path,
    fmt: str | None = None,
    *,
    block_size: int = 64,
    vocab_size: int = 150_000,
    skip_bad_lines: bool = False,
    limit: int | None = None,
    seed: int = 0,
    shape: ChatBranching | CodeEdit | None = None,
) -> Trace:
    """Read a trace into a workload (requests ordered by (timestamp, line)); ``shape``: the
    parameters of a generated shape (``gen:NAME``) or the sharing model of an Azure trace."""
    kind = detect_format(path, fmt)
    if kind == "log":
        return read_log_trace(path, limit=limit)
    if kind == "gen":
        from kvsched.replay.gentrace import generated_trace

        gen = shape if isinstance(shape, ChatBranching) else ChatBranching(vocab_size=vocab_size)
        return generated_trace(str(path), gen, seed, block_size, limit)
    sharing = {"sharing": shape} if kind == "azure" and isinstance(shape, CodeEdit) else {}
    reader: Any = read_mooncake if kind == "mooncake" else read_azure
    return reader(  # type: ignore[no-any-return]
        path,
        block_size=block_size,
        vocab_size=vocab_size,
        skip_bad_lines=skip_bad_lines,
        limit=limit,
        seed=seed,
        **sharing,
    )


# ------------------------------------------------------------------------ helpers


def _open_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line; a line that is not UTF-8 is an error naming it."""
    line = 0
    try:
        with open(path, "rb") as f:
            for line, raw in enumerate(f, start=1):
                yield line, raw.decode("utf-8")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}:{line}: not UTF-8 text ({exc.reason})") from None


def _show(value: object, width: int = 40) -> str:
    """``repr(value)``, shortened to about ``width`` characters for an error message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a {'negative ' if value < 0 else ''}{value.bit_length()}-bit integer"
    text = repr(value)
    return text if len(text) <= width else f"{text[: width - 3]}..."


def _check_int(value: object, name: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"field {name!r} must be an integer, got {_show(value)}")
    if value < minimum:
        raise ValueError(f"field {name!r} must be >= {minimum}, got {_show(value)}")
    if value > maximum:
        raise ValueError(
            f"field {name!r} must be <= {maximum:,} (the reader's limit), got {_show(value)}"
        )
    return value


def _int_field(row: dict[str, Any], name: str, minimum: int, maximum: int) -> int:
    if name not in row:
        raise ValueError(f"missing field {name!r}")
    return _check_int(row[name], name, minimum, maximum)


class _Collector:
    """Arrivals with their lines; bad lines raise or are counted."""

    def __init__(self, path: str | Path, skip_bad_lines: bool) -> None:
        self.path = path
        self.skip = skip_bad_lines
        self.bad: list[BadLine] = []
        self.lines = 0
        self.out_of_order = 0
        self.last_ts: float = -math.inf

    def bad_line(self, line: int, reason: str) -> None:
        if not self.skip:
            raise TraceError(f"{self.path}:{line}: {reason}")
        self.bad.append(BadLine(line, reason))

    def timestamp(self, ts: float) -> None:
        if ts < self.last_ts:
            self.out_of_order += 1
        self.last_ts = ts


_Row = TypeVar("_Row", bound=tuple[Any, ...])


def _order(rows: list[_Row]) -> list[_Row]:
    """Arrival order: (timestamp, line)."""
    return sorted(rows, key=lambda r: (r[0], r[1]))


# ------------------------------------------------------------------------ Mooncake


def read_mooncake(
    path: str | Path,
    *,
    block_size: int = 64,
    vocab_size: int = 150_000,
    skip_bad_lines: bool = False,
    limit: int | None = None,
    seed: int = 0,
) -> Trace:
    col = _Collector(path, skip_bad_lines)
    rows: list[tuple[float, int, tuple[int, int, list[int]]]] = []
    tails: dict[int, tuple[int, int]] = {}  # hash id -> (tokens in its block, first line)
    for line, text in _open_lines(path):
        if limit is not None and col.lines >= limit:
            break
        if not text.strip():
            continue
        col.lines += 1
        try:
            ts, n_in, n_out, ids = _mooncake_line(text)
            _check_tails(ids, n_in, tails, line)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            col.bad_line(line, _reason(exc))
            continue
        except RecursionError:
            col.bad_line(line, "malformed JSON (nested too deeply)")
            continue
        _commit_tails(ids, n_in, tails, line)
        col.timestamp(ts)
        rows.append((ts / 1000.0, line, (n_in, n_out, ids)))
    if not rows and not col.bad:
        raise TraceError(f"{path}: no requests in the trace")
    ordered = _order(rows)
    pool = BlockTokens(vocab_size, seed)
    turns: list[Turn] = []
    max_tokens = total = 0
    for seq_id, (at, _, (n_in, n_out, ids)) in enumerate(ordered):
        prompt = pool.prompt(ids, n_in)
        turns.append(Turn(ev.RequestArrived(seq_id, prompt, n_out), arrival_s=at))
        max_tokens = max(max_tokens, n_in + n_out)
        total += n_in + n_out
    ideal = sequential_ideal([r[2][2] for r in ordered], [r[2][0] for r in ordered], block_size)
    info = TraceInfo(
        str(path),
        "mooncake",
        col.lines,
        len(turns),
        tuple(col.bad),
        col.out_of_order,
        max_tokens,
        total,
        ideal,
    )
    return Trace(Workload(f"mooncake:{Path(path).name}", tuple(turns)), info)


def _mooncake_line(text: str) -> tuple[int, int, int, list[int]]:
    """(timestamp, input_length, output_length, hash_ids) of a line, each within its limit."""
    row = json.loads(text)
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    ts = _int_field(row, "timestamp", 0, MAX_TIMESTAMP_MS)
    n_in = _int_field(row, "input_length", 1, MAX_PROMPT_TOKENS)
    n_out = _int_field(row, "output_length", 1, MAX_OUTPUT_TOKENS)
    ids = row.get("hash_ids")
    if ids is None:
        raise ValueError("missing field 'hash_ids'")
    if not isinstance(ids, list):
        raise ValueError(f"field 'hash_ids' must be a list of integers, got {_show(ids)}")
    if len(ids) > MAX_HASH_IDS:
        raise ValueError(f"{len(ids):,} hash ids: at most {MAX_HASH_IDS:,} (the reader's limit)")
    for i, x in enumerate(ids):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_HASH_ID:
            raise ValueError(
                f"field 'hash_ids' must be a list of non-negative integers up to 2**63 - 1, "
                f"got {_show(x)} at index {i}"
            )
    if len(ids) != -(-n_in // MOONCAKE_BLOCK):
        raise ValueError(
            f"{len(ids)} hash ids for input_length {n_in} "
            f"(expected ceil({n_in} / {MOONCAKE_BLOCK}))"
        )
    return ts, n_in, n_out, ids


def _reason(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"malformed JSON ({exc.msg} at column {exc.colno})"
    if "integer string conversion" in str(exc):
        return "a number of more than 4300 digits (past every limit of the reader)"
    return str(exc)


def _check_tails(ids: list[int], n_in: int, tails: dict[int, tuple[int, int]], line: int) -> None:
    """Each id always stands for the same number of tokens (512, or its partial tail)."""
    last = len(ids) - 1
    for i, x in enumerate(ids):
        n = MOONCAKE_BLOCK if i < last else n_in - last * MOONCAKE_BLOCK
        seen = tails.get(x)
        if seen is not None and seen[0] != n:
            raise ValueError(f"hash id {x} covers {n} tokens here but {seen[0]} at line {seen[1]}")


def _commit_tails(ids: list[int], n_in: int, tails: dict[int, tuple[int, int]], line: int) -> None:
    last = len(ids) - 1
    for i, x in enumerate(ids):
        if x not in tails:
            tails[x] = (MOONCAKE_BLOCK if i < last else n_in - last * MOONCAKE_BLOCK, line)


# --------------------------------------------------------------------------- Azure


def _azure_time(text: str) -> int:
    """Time since the epoch (naive, read as UTC) in 100 ns ticks: all 7 fractional digits are
    kept exactly (a float of epoch seconds would round them)."""
    whole, _, frac = text.strip().partition(".")
    if frac and (not frac.isdigit() or len(frac) > 7):
        raise ValueError(f"bad timestamp {_show(text)}")
    try:
        stamp = dt.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.UTC)
    except ValueError:
        raise ValueError(
            f"bad timestamp {_show(text)} (expected YYYY-MM-DD HH:MM:SS.fffffff)"
        ) from None
    return int(stamp.timestamp()) * 10_000_000 + int(frac.ljust(7, "0") or 0)


def _azure_int(value: str, name: str, minimum: int, maximum: int) -> int:
    try:
        n = int(value)
    except ValueError:
        digits = value.strip().lstrip("+-")
        if digits.isdigit():  # past int()'s 4300 digits
            raise ValueError(
                f"field {name!r} must be <= {maximum:,} (the reader's limit), "
                f"got a {len(digits)}-digit number"
            ) from None
        raise ValueError(f"field {name!r} must be an integer, got {_show(value)}") from None
    return _check_int(n, name, minimum, maximum)


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _azure_line(text: str) -> tuple[int, int, int]:
    """(timestamp in 100 ns ticks, ContextTokens, GeneratedTokens), each within its limit."""
    fields = next(csv.reader([text]))
    if len(fields) != 3:
        raise ValueError(f"expected 3 fields, got {len(fields)}")
    ts = _azure_time(fields[0])
    n_in = _azure_int(fields[1], "ContextTokens", 1, MAX_PROMPT_TOKENS)
    n_out = _azure_int(fields[2], "GeneratedTokens", 1, MAX_OUTPUT_TOKENS)
    return ts, n_in, n_out


def read_azure(
    path: str | Path,
    *,
    block_size: int = 64,
    vocab_size: int = 150_000,
    skip_bad_lines: bool = False,
    limit: int | None = None,
    seed: int = 0,
    sharing: CodeEdit | None = None,
) -> Trace:
    """An Azure CSV trace: its own tokens per request (nothing shared), or with ``sharing``
    the tokens of that sharing model (``replay/sharing.py``)."""
    col = _Collector(path, skip_bad_lines)
    rows: list[tuple[int, int, tuple[int, int]]] = []
    lines = _open_lines(path)
    header = next(lines, None)
    if header is None or tuple(c.strip() for c in header[1].split(",")) != AZURE_COLUMNS:
        raise TraceError(f"{path}:1: expected the header {','.join(AZURE_COLUMNS)}")
    for line, text in lines:
        if limit is not None and col.lines >= limit:
            break
        if not text.strip():
            continue
        col.lines += 1
        try:
            ts, n_in, n_out = _azure_line(text)
        except (ValueError, csv.Error) as exc:
            col.bad_line(line, str(exc))
            continue
        col.timestamp(ts)
        rows.append((ts, line, (n_in, n_out)))
    if not rows and not col.bad:
        raise TraceError(f"{path}: no requests in the trace")
    ordered = _order(rows)
    t0 = ordered[0][0] if ordered else 0
    turns: list[Turn] = []
    shared = code_edit_prompts(sharing, [r[2][0] for r in ordered], seed) if sharing else None
    for seq_id, (at, line, (n_in, n_out)) in enumerate(ordered):
        # No prefix identity: the request's own tokens, keyed by its line (or the model's).
        if shared is None:
            prompt = synth_tokens(np.asarray([line]), n_in, vocab_size, seed + 0x5EED)[0]
        else:
            prompt = shared[seq_id]
        turns.append(Turn(ev.RequestArrived(seq_id, prompt, n_out), arrival_s=(at - t0) / 1e7))
    info = TraceInfo(
        str(path),
        "azure",
        col.lines,
        len(turns),
        tuple(col.bad),
        col.out_of_order,
        max((a + b for _, _, (a, b) in rows), default=0),
        sum(a + b for _, _, (a, b) in rows),
        token_ideal(shared, block_size) if shared is not None else 0.0,
    )
    name = f"azure:{Path(path).name}" + (" sharing code-edit" if sharing else "")
    return Trace(Workload(name, tuple(turns)), info)


# ----------------------------------------------------------------------- event log


def read_log_trace(path: str | Path, *, limit: int | None = None) -> Trace:
    """The arrivals of a kvsched event log, at their logged arrival times (open loop)."""
    from kvsched.events.codec import RecordDecodeError
    from kvsched.events.log import CorruptLogError

    try:
        rows = _log_arrivals(str(path), limit)
    except (CorruptLogError, RecordDecodeError, ValueError) as exc:
        raise TraceError(str(exc)) from None
    except FileNotFoundError:
        raise TraceError(f"{path}: no such event log") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read event log ({exc.strerror or exc})") from None
    if not rows:
        raise TraceError(f"{path}: the event log holds no requests")
    ordered = _order(rows)
    turns = tuple(Turn(e, arrival_s=at) for at, _, e in ordered)
    lengths = [len(e.prompt) + e.max_tokens for _, _, e in ordered]
    info = TraceInfo(
        str(path), "log", len(rows), len(turns), (), 0, max(lengths), sum(lengths), None
    )
    return Trace(Workload(f"log:{Path(path).name}", turns), info)


def _log_arrivals(path: str, limit: int | None) -> list[tuple[float, int, ev.RequestArrived]]:
    """(arrival time, order, arrival) of a log's arrivals, read one record at a time."""
    from kvsched.events.codec import check_schema, decode_record
    from kvsched.events.log import LogReader

    reader = LogReader(path)
    check_schema(reader.header, f"event log {path}")
    rows: list[tuple[float, int, ev.RequestArrived]] = []
    for _, payload in reader:
        e: ev.Event
        for e in decode_record(payload).inputs:
            if isinstance(e, ev.RequestArrived):
                rows.append((e.arrival_time, len(rows) + 1, e))
                if limit is not None and len(rows) >= limit:
                    return rows
    return rows


def log_config(path: str | Path) -> dict[str, Any]:
    """The scheduler config recorded in an event log's header (only the header is read)."""
    from kvsched.events.log import LogReader

    header = LogReader(str(path)).header
    config = header.get("config")
    if not isinstance(config, dict):
        raise TraceError(f"{path}: the log header has no config")
    return config
