"""Apply each hand-written mutant of a scheduler rule in a temporary copy of the tree, run the
tests meant to catch it there, and report: every mutant must be caught.

    python3 scripts/guard_mutants.py            # CAUGHT / SURVIVED per mutant; exit 1 if one
    python3 scripts/guard_mutants.py -k floor   # only the mutants whose text contains "floor"
    python3 scripts/guard_mutants.py --vllm --python .venv-vllm/bin/python  # the vLLM ones

The real sources are never edited: ``src/``, ``tests/`` and ``pyproject.toml`` are copied to a
temporary directory (the built kvs128 kernel included), each mutant is written into the copy,
its tests run there with ``PYTHONPATH=<copy>/src``, and the copy's file is put back. So an
interrupted run leaves nothing behind. A mutant whose original text is not found exactly once
is an error (exit 1): the rule moved, update this list.

The mutants: the guards a mutation probe found untested in issue 12, the eleven rules of
issue 24 and the three slips issue 24 found caught only far from their code (``MUTANTS``);
issue 24's second round, slips in the code the next round added or changed (``ROUND_2``).
Both run by default. ``--vllm`` runs instead the round-2 slips whose tests need vLLM
(``VLLM_ROUND_2``), with the interpreter of ``--python`` (default: ``$KVSCHED_VLLM_PYTHON``,
else ``.venv-vllm/bin/python``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class Mutant(NamedTuple):
    path: str  # under src/kvsched
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest arguments: files or node ids (-k included if needed)


def m(path: str, old: str, new: str, *tests: str) -> Mutant:
    return Mutant(path, old, new, tests)


BUDGET = "budget.tokens + chunk.end - chunk.start <= self.config.max_prefill_tokens"
SPAN_END = "hi = min(last_block, (span.end - 1) // block_size + 1)"
RETRIES = "if seq.num_failures > self.config.max_step_retries:"
SCHED, IDENT = "tests/policy/test_scheduler.py", "tests/test_identity.py"
FLOOR = "self.floor = max(self.floor, e.priority)"
FIT = "return need <= pool.num_available - pool.count_unheld(hit)"
SETTLE_STOP = """            if verdict == "stop" and stop_on_failure:
                return False"""
SIZE = "cdiv(n, chunk) - start // chunk"
SAFE_LOOP = "step = min(starts) // block_size * block_size"
SPARES = "limit - 2)"
MISSING = "return _torn(file, offset, size, path, offset + PREFIX_SIZE)"
REL = "rel = sorted((b - first_block, x) for b, x in extras.items() if x)"
ADMISSION, ORDERING = "tests/policy/test_admission.py", "tests/policy/test_ordering.py"
MUTANTS = [
    # issue 12: guards a mutation probe once found untested
    m("policy/admission.py", BUDGET, BUDGET.replace("<=", "<"), SCHED, "-k", "budget"),
    m("policy/admission.py", BUDGET, BUDGET + " + 1", SCHED, "-k", "budget"),
    m("identity.py", SPAN_END, SPAN_END.replace(" + 1)", ")"), IDENT),
    m("identity.py", SPAN_END, "hi = min(last_block, span.end // block_size + 1)", IDENT),
    m(
        "policy/checkpoints.py",
        "return ((p, c) for p, c in victims if c.ckpt_id != keep)",
        "return iter(victims)",
        "tests/policy/test_hybrid.py", "-k", "never_evicts",
    ),
    m(
        "policy/growth.py",
        "order = sorted(sessions, key=lambda k: (sessions[k].last_used, k))",
        "order = sorted(sessions, key=lambda k: (-sessions[k].last_used, k))",
        SCHED, "-k", "idle_session",
    ),
    m(
        "reducers/transfers.py",
        "load.num_blocks = min(e.num_blocks, load.num_blocks)",
        "load.num_blocks = e.num_blocks",
        "tests/replay/test_external.py", "-k", "beyond",
    ),
    m("policy/scheduler.py", RETRIES, RETRIES.replace(">", ">="), SCHED, "-k", "retries"),
    m("policy/scheduler.py", RETRIES, RETRIES.replace(":", " + 1:"), SCHED, "-k", "retries"),
    # issue 24, rules 1-11
    m(
        "policy/checkpoints.py",
        "if priority is not None and priority > worth:",
        "if priority is not None and priority >= worth:",
        "tests/policy/test_checkpoints.py", "-k", "worth_exactly",
    ),
    m("reducers/checkpoints.py", FLOOR, "self.floor = e.priority",
      "tests/reducers/test_checkpoints.py", "-k", "floor"),
    m(
        "policy/ordering.py",
        """        if self.config.order == "priority":
            return self._by_priority(seqs, state.clock)
        return sorted(seqs, key=_seq_arrival)""",
        "        return sorted(seqs, key=_seq_arrival)",
        ORDERING, "-k", "ready_loads",
    ),
    m("policy/admission.py", FIT, "return need <= pool.num_available", ADMISSION),
    m(
        "policy/admission.py",
        'return "skip"  # every row runs (only loads start now)',
        'return "stop"  # every row runs (only loads start now)',
        ADMISSION,
    ),
    m("policy/admission.py", SETTLE_STOP, SETTLE_STOP.replace("False", "True"), ADMISSION),
    m("policy/ordering.py", SIZE, "cdiv(n - start, chunk)", ORDERING, "-k", "canonical"),
    m(
        "policy/turns.py",
        "left = table.tokens_left(chunk_rows)",
        "left = table.known_of(chunk_rows)",
        "tests/policy/test_turns.py", "-k", "last_chunk",
    ),
    m("policy/spans.py", SAFE_LOOP, "return min(starts) // block_size",
      "tests/policy/test_spans.py"),
    m("policy/growth.py", SPARES, "limit - 1)", "tests/policy/test_growth.py"),
    m("events/framing.py", MISSING, MISSING.replace("offset + PREFIX_SIZE", "size + PREFIX_SIZE"),
      "tests/events/test_framing_rules.py"),
    # issue 24: slips once caught only far from their code
    m(
        "policy/checkpoints.py",
        'elif config.places("session_end") and seq.session_id >= 0:',
        'elif config.places("session_end") and seq.session_id > 0:',
        "tests/policy/test_checkpoints.py", "-k", "session_0",
    ),
    m("policy/spans.py", "not span.start < step < span.end", "not span.start <= step < span.end",
      "tests/policy/test_spans.py"),
    m("identity.py", REL, REL.replace("(b - first_block, x)", "(b, x)"), IDENT, "-k", "continued"),
]  # fmt: skip

# Round 2 (issue 24's third item): slips in the code the round after issue 24 added or changed
# (CLI refusals and exits, trace limits, the log writer's cut-back, report columns, Engine.step's
# input check, checkpoint loading, the floor invariant, the vLLM adapter's translation rules).
CLI, CLI_ERRORS = "tests/test_cli.py", "tests/test_cli_errors.py"
CHECKS, INIT, FRAMING = "cli/checks.py", "cli/__init__.py", "events/framing.py"
TRACES, LOG = "tests/replay/test_traces.py", "tests/events/test_log.py"
WATCH, REPORT = "tests/stream/test_watch.py", "tests/replay/test_report.py"
TRANSLATION = "tests/integrations/vllm/test_vllm_translation.py"
HOLD = "tests/policy/test_admission_hold.py"
SKIP = "tests/policy/test_skip_prefix_hit.py"
PIPELINED = "tests/test_engine_pipelined.py"
EXISTS = "if os.path.isfile(path) and not overwrite:"
NONEMPTY = "if where.is_dir() and any(where.iterdir()) and not overwrite:"
SWEPT = 'getattr(args, key.replace("-", "_"), None)'
MEMORY = 'memory = "checkpoint-memory" in keys or args.checkpoint_memory is not None'
PREFIX_OK = "if check != _crc32(prefix[:8]) or offset > size:"
EXCEPTS = """    except BrokenPipeError:
        return _stdout_closed()
    except OSError as exc:  # any other file a command could not read or write
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return fail(f"{where}{exc.strerror or exc}")"""
EXCEPTS_SWAPPED = """    except OSError as exc:  # any other file a command could not read or write
        where = f"{exc.filename}: " if exc.filename is not None else ""
        return fail(f"{where}{exc.strerror or exc}")
    except BrokenPipeError:
        return _stdout_closed()"""
CAUGHT = "(SetupError, TraceError, LogOpenError, LogWriteError, ReportError, WireError)"
WAIT = """    if args.wait_subscribers and not args.publish:
        raise _no_effect("--wait-subscribers", "--publish")
"""
TIMEOUT = """        except WireTimeout as exc:
            watched.stopped = str(exc)
"""
IDS = "if len(ids) > MAX_HASH_IDS:"
ID_RANGE = "not 0 <= x <= MAX_HASH_ID"
TAIL = "parts[-1] = parts[-1][: n_in - (len(ids) - 1) * MOONCAKE_BLOCK]"
DEEP = """        except RecursionError:
            col.bad_line(line, "malformed JSON (nested too deeply)")
            continue
"""
FLUSHED = "self._flushed, self._flushed_records = self._offset, self._records"
ROWS = "f\"{m['kv_block_evictions']:,} KV blocks, {m['checkpoint_evictions']:,} checkpoints\""
ENV_OVERWRITE = 'out["overwrite_log"] = os.environ.get(OVERWRITE_ENV, "") == "1"'
REQUEST_CHECK = 'n.split(":")[-1].split(".")[-1] == "RequestCheck"'
PARAMS = """    reason = params_refusal(params)
    if reason is not None:
        return reason
"""
ROUND_2 = [
    # cli.py: files a command writes
    m(CHECKS, EXISTS, EXISTS.replace("not overwrite", "overwrite"), CLI, "-k", "overwrite"),
    m(CHECKS, "if same_file(path, given):", "if path == given:", CLI, "-k", "never"),
    m(
        "cli/run.py",
        'check_output("--log", args.log, args.overwrite, inputs=[args.trace])',
        'check_output("--log", args.log, args.overwrite)',
        CLI, "-k", "never",
    ),
    m(
        "cli/bench.py",
        '        check_output("--log", args.log, args.overwrite)\n        try:',
        "        try:",
        CLI, "-k", "bench",
    ),
    m("cli/watch.py", '    check_output("--dump", args.dump, args.overwrite)\n', "", WATCH, "-k",
      "existing_dump"),
    m(CHECKS, NONEMPTY, "if where.is_dir() and not overwrite:", CLI, "-k", "empty_directory"),
    m(CHECKS, "for p in made:", "for p in made[:1]:", CLI, "-k", "probe_leaves"),
    # cli.py: options another option overrides or ignores
    m(CHECKS, SWEPT, "getattr(args, key, None)", CLI, "-k", "overrides"),
    m(CHECKS, MEMORY, "memory = args.checkpoint_memory is not None", CLI, "-k", "memory_sweep"),
    m(CHECKS, WAIT, "", CLI, "-k", "ignored"),
    # cli.py: exits and the record count
    m(
        "cli/output.py",
        "    return fail(failed) if failed else 0\n",
        "    return 0\n",
        CLI, "-k", "report_that_fails",
    ),
    m(INIT, EXCEPTS, EXCEPTS_SWAPPED, CLI_ERRORS, "-k", "stdout or head"),
    m(INIT, CAUGHT, CAUGHT.replace(" LogWriteError,", ""), CLI_ERRORS, "-k", "logging"),
    m(FRAMING, "return max(frames - 1, 0)", "return max(frames, 0)", CLI, "-k", "total or count"),
    m(FRAMING, PREFIX_OK, PREFIX_OK.replace("> size", ">= size"), CLI, "-k", "total or count"),
    m("stream/watch.py", TIMEOUT, "", WATCH, "-k", "timeout"),
    # replay/traces.py: the documented limits
    m("replay/traces.py", IDS, IDS.replace(">", ">="), TRACES, "-k", "limits"),
    m("replay/traces.py", ID_RANGE, ID_RANGE.replace("x <=", "x <"), TRACES, "-k", "large"),
    m("replay/traces.py", "if value > maximum:", "if value >= maximum:", TRACES, "-k", "limits"),
    m(
        "replay/traces.py",
        'ts = _int_field(row, "timestamp", 0, MAX_TIMESTAMP_MS)',
        'ts = _int_field(row, "timestamp", 0, MAX_HASH_ID)',
        TRACES, "-k", "limit",
    ),
    m("replay/synth.py", TAIL, "parts[-1] = parts[-1][: n_in % MOONCAKE_BLOCK]", TRACES,
      "-k", "limits"),
    m(
        "replay/traces.py",
        "except (ValueError, csv.Error) as exc:",
        "except ValueError as exc:",
        TRACES, "-k", "azure",
    ),
    m("replay/traces.py", DEEP, "", TRACES, "-k", "limit"),
    # (equivalent, not listed: MAX_PROMPT_TOKENS for MAX_OUTPUT_TOKENS; both are 2**20)
    # events/log.py: a failed write cuts the log back to its last flushed record
    m(
        "events/log.py",
        "_close_and_cut(self._file, self._flushed)",
        "_close_and_cut(self._file, self._offset)",
        LOG, "-k", "full_disk",
    ),
    m("events/log.py", FLUSHED, "self._flushed = self._offset", LOG, "-k", "full_disk"),
    m(
        "events/log.py",
        "self._file.truncate(self._offset)",
        "self._file.truncate()",
        LOG, "-k", "interruption",
    ),
    m(
        "events/log.py",
        "log._records = log._flushed_records = records",
        "log._records = records",
        LOG, "-k", "open_append",
    ),
    # replay/metrics.py, replay/report.py: evictions split in two
    m(
        "replay/metrics.py",
        '"checkpoint_evictions": self.engine.state.ckpts.evictions',
        '"checkpoint_evictions": pool.num_evictions',
        "tests/replay/test_metrics.py",
    ),
    m("replay/report.py", ROWS, ROWS.replace("kv_block", "X").replace("checkpoint_e", "kv_block_e")
      .replace("X", "checkpoint"), REPORT, "-k", "summary_table"),
    m(
        "replay/report.py",
        "{m['kv_block_evictions']:>12,}",
        "{m['checkpoint_evictions']:>12,}",
        REPORT, "-k", "sweep_table",
    ),
    m(
        "replay/report.py",
        'return 1000 * float(m["ttft_p99_s"])',
        'return 1000 * float(m["ttft_p50_s"])',
        REPORT, "-k", "p99_panel",
    ),
    m("replay/report.py", "lo = max(float(ms.min()), 0.1)", "lo = float(ms.min())", REPORT,
      "-k", "0_ms"),
    # engine.py, gpu/model.py, reducers/checkpoints.py
    m(
        "engine.py",
        "isinstance(inputs, (ev.Event, str, bytes, Mapping))",
        "isinstance(inputs, (ev.Event, str, bytes))",
        "tests/test_engine.py", "-k", "list",
    ),
    m(
        "engine.py",
        "items = list(inputs) if isinstance(inputs, list) else _input_list(inputs)",
        "items = list(inputs)",
        "tests/test_engine.py", "-k", "list",
    ),
    m(
        "gpu/model.py",
        "unexpected = sorted(found.keys() - expected.keys())",
        "unexpected = sorted(expected.keys() - found.keys())",
        "tests/gpu/test_model_loading.py", "-k", "unexpected",
    ),
    m(
        "reducers/checkpoints.py",
        "self.floor_mark = max(self.floor_mark, self.floor)",
        "self.floor_mark = self.floor",
        "tests/reducers/test_checkpoints.py", "-k", "lowered_aging",
    ),
    # integrations/vllm: the rules that run without vLLM
    m("integrations/vllm/config.py", ENV_OVERWRITE,
      'out["overwrite_log"] = bool(os.environ.get(OVERWRITE_ENV))', TRANSLATION),
    m(
        "integrations/vllm/config.py",
        "if not isinstance(out[flag], bool):",
        "if out[flag] is None:",
        TRANSLATION,
    ),
    m("integrations/vllm/config.py", 'release = found.split("+", 1)[0]', "release = found",
      TRANSLATION),
    m("integrations/vllm/config.py", "    if allow_untested:\n", "    if not allow_untested:\n",
      TRANSLATION),
    m(
        "integrations/vllm/requests.py",
        "if detection is not None and detection.max_pattern_size > 0:",
        "if detection is not None:",
        TRANSLATION,
    ),
    m(
        "integrations/vllm/config.py",
        "if os.path.lexists(path) and not overwrite:",
        "if os.path.lexists(path) and overwrite:",
        TRANSLATION,
    ),
    m("integrations/vllm/config.py", REQUEST_CHECK, 'n.split(":")[-1] == "RequestCheck"',
      TRANSLATION),
    m(
        "integrations/vllm/requests.py",
        'skip_prefix_hit=bool(getattr(request, "skip_reading_prefix_cache", False)),',
        "skip_prefix_hit=False,",
        TRANSLATION,
    ),
    m("policy/matching.py", "if not self.config.enable_prefix_caching or seq.skip_hit:",
      "if not self.config.enable_prefix_caching:", SKIP),
    m("policy/transfers.py", "or self._no_state_slot or seq.skip_hit:",
      "or self._no_state_slot:", SKIP),
    m(
        "integrations/vllm/requests.py",
        "request.max_tokens < 1:",
        "request.max_tokens <= 1:",
        TRANSLATION,
    ),
    m("integrations/vllm/requests.py", PARAMS, "", TRANSLATION),
    m(
        "integrations/vllm/run.py",
        "batched = batched if not args.hybrid else length",
        "batched = length",
        TRANSLATION,
    ),
    # held admissions (AdmissionsHeld, vLLM's PAUSED_NEW)
    m("policy/admission.py", "        if state.serving.admissions_held:\n",
      "        if False:\n", HOLD),
    m("reducers/state.py", "(not held or bool(self.transfers.ready_loads()))",
      "(True or bool(self.transfers.ready_loads()))", HOLD),
    m("reducers/work.py", "self.admissions_held = bool(e.held)", "self.admissions_held = True",
      HOLD),
    # PAUSED_ALL: while running work is held too, nothing is scheduled (a drain still is)
    m("reducers/work.py", "self.running_held = bool(e.held and e.running)",
      "self.running_held = False", HOLD),
    m("policy/scheduler.py", "        if state.serving.running_held:\n            return\n",
      "", HOLD),
    # LoRA: a waiting sequence whose adapter would be one too many is skipped
    m("policy/admission.py",
      "return seq.adapter not in running and len(running) >= self._lora_slots",
      "return False", "tests/policy/test_adapters.py"),
    # overlapped steps (speculation.pipelined)
    m("reducers/pipeline.py", "            kept = ~np.isin(samplers, gone)\n",
      "            kept = np.ones(len(samplers), bool)\n", PIPELINED),
    m("reducers/planner.py", "newest = np.where(table.ahead[rows[decode]] > 0, -1, newest)",
      "newest = newest", PIPELINED),
    m("policy/scheduler.py", "            rows = table.not_at_end(rows)\n", "            pass\n",
      PIPELINED),
    m("reducers/pipeline.py", "            later = self._roll_back(voided)",
      "            later = _NO_ROWS", PIPELINED),
    m("reducers/rows.py", "            computed = self.cacheable()\n",
      "            computed = self.computed\n", PIPELINED),
    m("policy/scheduler.py", "            if seq.tokens[seq.n_tokens - 1] == seq.eos_token_id:",
      "            if False:", PIPELINED),
    # overlapped steps with drafts: rejected drafts (and those past the end) uncomputed
    m("reducers/pipeline.py", "        uncomputed = 1 + drafts - (self.ntokens[rows] - before)\n",
      "        uncomputed = 0 * drafts\n", PIPELINED, "-k", "drafts"),
    # a hybrid decode-time state under overlapped steps is saved before the next forward
    m("policy/checkpoints.py", 'kind, "before", True)', 'kind, "after", True)', PIPELINED,
      "-k", "decode_time"),
]  # fmt: skip

# Round 2, the vLLM adapter's slips that need vLLM: run with --vllm in .venv-vllm.
SCHEDULER_TESTS = "tests/integrations/vllm/test_vllm_scheduler.py"
HARNESS_TESTS = "tests/integrations/vllm/test_vllm_harness.py"
GRAMMAR_TESTS = "tests/integrations/vllm/test_vllm_grammar.py"
SPEC_TESTS = "tests/integrations/vllm/test_vllm_speculative.py"
VLLM_ROUND_2 = [
    m(
        "integrations/vllm/startup.py",
        'cfg.check_log_path(path, opts["overwrite_log"])',
        'cfg.check_log_path(path, opts.get("overwrite", False))',
        SCHEDULER_TESTS, "-k", "existing_log",
    ),
    # the asynchronous call order: no step planned while an earlier one's outcome is out
    # (overlapped steps: one may be)
    m("integrations/vllm/scheduler.py",
      "if out and (out > 1 or not self.config.speculation.pipelined):",
      "if False:", HARNESS_TESTS, "-k", "empty_step_while"),
    m("integrations/vllm/scheduler.py", "        if not self._awaiting:\n",
      "        if False:\n", HARNESS_TESTS, "-k", "did_not_schedule"),
    m("integrations/vllm/worker.py", "        self._prev = set()\n",
      "        pass\n", HARNESS_TESTS, "-k", "empty_step_while"),
    # structured outputs: a request waits for its grammar; its rows get the bitmask
    m("integrations/vllm/scheduler.py", "        if request.use_structured_output:\n",
      "        if False:\n", GRAMMAR_TESTS, "-k", "once_its_grammar"),
    m("integrations/vllm/scheduler.py",
      "        return self.grammars.bitmask(self.requests, self._grammar_rows, spec)",
      "        return None", GRAMMAR_TESTS, "-k", "token_identical"),
    # structured outputs with drafts: drafts cut by the grammar, a bitmask row per draft
    m("integrations/vllm/grammar.py", "self.manager.validate_tokens(request, drafts)", "drafts",
      SPEC_TESTS, "-k", "structured"),
    m("integrations/vllm/grammar.py", "self.manager.grammar_bitmask(requests, names, spec)",
      "self.manager.grammar_bitmask(requests, names, {})", SPEC_TESTS, "-k", "structured"),
    # LoRA: max_loras becomes kvsched's model.max_adapters
    m("integrations/vllm/config.py",
      "max_adapters=int(lora.max_loras) if lora is not None else 0", "max_adapters=0",
      "tests/integrations/vllm/test_vllm_lora.py"),
    # PAUSED_ALL: nothing scheduled while vLLM is paused
    m("integrations/vllm/scheduler.py", "running = pause_state == PauseState.PAUSED_ALL",
      "running = False", SCHEDULER_TESTS, "-k", "paused_all"),
    # (survives, left: RequestCheck raising ValueError; LLM.generate still reported
    # VLLMValidationError with the reason in vLLM 0.32, so no observable change was found)
    # async scheduling: num_output_tokens counts the placeholders (the runner cuts to it)
    m("integrations/vllm/scheduler.py",
      "out_ids = self.engine.state.seqs.placeholders_of(plan.seq_ids)",
      "out_ids = 0 * self.engine.state.seqs.placeholders_of(plan.seq_ids)", HARNESS_TESTS,
      "-k", "drafts_in_the_async"),
    # async scheduling, structured rows with tokens out: the bitmask waits for them
    m("integrations/vllm/grammar.py", "so.pending_structured_output_tokens = any(",
      "so.pending_structured_output_tokens = False and any(", HARNESS_TESTS,
      "-k", "overlaps_structured"),
    # a save relabels its block when its step is scheduled, not when the output is back
    m("integrations/vllm/scheduler.py",
      "            self.mamba.relabel(plan.state_save, self.engine.check)\n",
      "            pass  # (relabelled later)\n", HARNESS_TESTS, "-k", "hybrid"),
    # async scheduling kept on for vLLM's CPU build only (a GPU keeps its CUDA events)
    m("integrations/vllm/cpu_async.py", "if not current_platform.is_cpu() or getattr(",
      "if getattr(", "tests/integrations/vllm/test_vllm_cpu_async.py"),
    # ngram_gpu's pinned buffers on vLLM's CPU build (ngram drafts under async scheduling)
    m("integrations/vllm/cpu_async.py", "torch.zeros = _unpinned(torch.zeros)",
      "torch.zeros = torch.zeros", "tests/integrations/vllm/test_vllm_cpu_async.py"),
    # an EAGLE drafter's lookahead slots
    m("integrations/vllm/config.py",
      "lookahead=int(vllm_config.num_lookahead_tokens)", "lookahead=0",
      HARNESS_TESTS, "-k", "eagle"),
]  # fmt: skip


def copy_tree(dest: Path) -> None:
    """What the tests need, without caches: the mutants are applied to this copy only."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for name in ("src", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def check_found(mutants: list[Mutant]) -> list[str]:
    """Each mutant's text, found exactly once in the real source (else an error line)."""
    errors = []
    for mu in mutants:
        count = (ROOT / "src" / "kvsched" / mu.path).read_text().count(mu.old)
        if count != 1:
            errors.append(f"ERROR    {mu.path}: {mu.old!r} found {count} times: update this list")
    return errors


def run_one(
    tree: Path, mu: Mutant, env: dict[str, str], python: str = sys.executable
) -> tuple[bool, str]:
    """(caught, the first failure's summary line) with the mutant applied in ``tree``."""
    path = tree / "src" / "kvsched" / mu.path
    source = path.read_text()
    path.write_text(source.replace(mu.old, mu.new))
    try:
        cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf"]
        result = subprocess.run(
            [*cmd, "--tb=short", *mu.tests], cwd=tree, env=env, capture_output=True, text=True
        )
    finally:
        path.write_text(source)
    lines = result.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAILED")]
    errors = [line for line in lines if line.startswith("E ")]
    why = " | ".join([*failed[:1], *errors[:1]]) or result.stdout.strip()[-300:]
    # 1: tests ran and failed (5 would be: none selected; others: an error, not a catch)
    return result.returncode == 1, why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only mutants whose new text contains this")
    parser.add_argument("--vllm", action="store_true", help="the slips whose tests need vLLM")
    parser.add_argument("--python", help="the interpreter that runs the tests")
    args = parser.parse_args(argv)
    python = args.python or sys.executable
    if args.vllm and not args.python:
        python = os.environ.get("KVSCHED_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    chosen = VLLM_ROUND_2 if args.vllm else [*MUTANTS, *ROUND_2]
    mutants = [mu for mu in chosen if args.k in mu.new or args.k in mu.path]
    errors = check_found(mutants)
    for line in errors:
        print(line)
    survived = 0
    with tempfile.TemporaryDirectory(prefix="kvsched-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
        where = subprocess.run(
            [python, "-c", "import kvsched; print(kvsched.__file__)"],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not Path(where).is_relative_to(tree):
            raise SystemExit(f"the copy's tests would import kvsched from {where}, not the copy")
        for mu in mutants:
            if check_found([mu]):
                continue
            caught, why = run_one(tree, mu, env, python)
            survived += not caught
            first = (mu.new.strip() or f"(deleted) {mu.old.strip()}").splitlines()[0]
            print(f"{'CAUGHT  ' if caught else 'SURVIVED'} {mu.path}: {first}\n         {why}")
            sys.stdout.flush()
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
