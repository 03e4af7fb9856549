"""Prefill/decode disaggregation with ``KvschedConnector``: two vLLM engines under kvsched and a
small proxy between them.

    python -m kvsched.integrations.vllm.disagg engine MODEL --role prefill --store dir:S
    python -m kvsched.integrations.vllm.disagg engine MODEL --role decode  --store dir:S

Each engine is one process (an ``LLMEngine`` stepping while it has requests) reading requests
as JSON lines on stdin (``{"id", "prompt", "max_tokens", "kv_transfer_params"}``) and writing
one JSON line per finished request on stdout (``{"id", "tokens", "num_cached_tokens",
"kv_transfer_params"}``); a line it cannot serve is answered ``{"id", "error"}`` and the
engine goes on. The engine settings are the tested ones (``engine_args``: greedy, eager,
small batches), a demonstration of the protocol rather than a tuned deployment.

The prefill engine (``kv_producer``) computes each prompt and its first token and saves every
block it caches, with the states of its checkpoints for a hybrid model; the decode engine
(``kv_consumer``) saves nothing. ``Proxy`` routes each request as vLLM's disaggregation
proxies do: to the prefill engine with ``max_tokens=1``, then, with the ``kv_transfer_params``
it returned, to the decode engine with the request's own ``max_tokens``. The decode engine's
lookup waits until the store holds the prompt blocks the prefill engine computed
(``StoreBridge``), so it loads them and computes only the rest of the prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
from typing import Any, TextIO

from kvsched.integrations.vllm.run import in_process_core

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
SCHEDULER = "kvsched.integrations.vllm.Scheduler"


def engine_args(model: str, role: str, store: str, hybrid: bool) -> dict[str, Any]:
    """The ``LLM`` / ``EngineArgs`` keywords of one engine of the pair (a hybrid model's
    state dtype pinned, ``models.STATE_DTYPE``: vLLM derives the block size from it, so it
    is the same on every CPU)."""
    from kvsched.integrations.vllm.models import STATE_DTYPE

    states = {"mamba_ssm_cache_dtype": STATE_DTYPE} if hybrid else {}
    return states | {
        "model": model,
        "enforce_eager": True,
        "max_model_len": 4096 if hybrid else 2048,
        "dtype": "bfloat16" if hybrid else "float32",
        "block_size": None if hybrid else 32,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 4,
        "seed": 0,
        "skip_tokenizer_init": True,
        "enable_prefix_caching": True,
        "scheduler_cls": SCHEDULER,
        "kv_transfer_config": {
            "kv_connector": "KvschedConnector",
            "kv_connector_module_path": "kvsched.integrations.vllm.store_connector",
            "kv_role": ROLES[role],
            "kv_connector_extra_config": {"store": store},
        },
    }


def serve(args: dict[str, Any], stdin: TextIO, stdout: TextIO) -> None:
    """Run one engine until stdin closes and its requests are done."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    queue_size = getattr(in_process_core(engine), "batch_queue_size", None)  # (2: async loop)
    print(json.dumps({"ready": True, "batch_queue_size": queue_size}), file=stdout, flush=True)
    open_input = True
    while open_input or _busy(engine):
        block = not _busy(engine)
        while open_input:
            try:
                line = lines.get(block=block)
            except queue.Empty:
                break
            if line is None:
                open_input = False
                break
            block = False
            try:
                r = parse_request(line)
                extra = (
                    {"kv_transfer_params": r["kv_transfer_params"]}
                    if r["kv_transfer_params"]
                    else None
                )
                params = SamplingParams(
                    max_tokens=r["max_tokens"],
                    temperature=0,
                    ignore_eos=True,
                    detokenize=False,
                    extra_args=extra,
                )
                engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]), params)
            except ValueError as exc:  # (a bad line is answered; the engine goes on)
                print(json.dumps({"id": _id_of(line), "error": str(exc)}), file=stdout, flush=True)
        for out in engine.step() if _busy(engine) else ():
            if out.finished:
                done = {
                    "id": out.request_id,
                    "tokens": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                    "kv_transfer_params": out.kv_transfer_params,
                }
                print(json.dumps(done), file=stdout, flush=True)
    print(json.dumps({"left": _left(engine)}), file=stdout, flush=True)
    engine.engine_core.shutdown()  # (closes the scheduler: its event log is complete)


def parse_request(line: str) -> dict[str, Any]:
    """A request line, checked: ``ValueError`` naming what is wrong."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"a request line must be a JSON object: {exc}") from None
    if not isinstance(r, dict):
        raise ValueError("a request line must be a JSON object")
    unknown = set(r) - {"id", "prompt", "max_tokens", "kv_transfer_params"}
    if unknown:
        raise ValueError(f"unknown request keys {sorted(unknown)}")
    prompt, max_tokens, params = r.get("prompt"), r.get("max_tokens"), r.get("kv_transfer_params")
    if not isinstance(r.get("id"), str) or not r["id"]:
        raise ValueError("'id' must be a non-empty string")
    if not isinstance(prompt, list) or not prompt or not all(_is_token(t) for t in prompt):
        raise ValueError("'prompt' must be a non-empty list of token ids (ints >= 0)")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError("'max_tokens' must be an int >= 1")
    if params is not None and not isinstance(params, dict):
        raise ValueError("'kv_transfer_params' must be an object or null")
    return {"id": r["id"], "prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": params}


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _id_of(line: str) -> Any:
    """The id of a request line, if it has one (for its error answer)."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError:
        return None
    return r.get("id") if isinstance(r, dict) else None


def _left(engine: Any) -> dict[str, Any] | None:
    """What kvsched's scheduler (an engine core in this process) still has in flight: the
    sequences loading and the saves unreported (both empty once every request is done)."""
    sched = getattr(in_process_core(engine), "scheduler", None)
    if sched is None or not hasattr(sched, "engine"):
        return None
    loads, saves = sched.engine.transfers_in_flight()
    return {"loads": loads, "saves": saves}


def _busy(engine: Any) -> bool:
    """Requests unfinished, or (an engine core in this process) work its scheduler still
    owes them: a finished prefill's saves land in the steps after its last token."""
    core = in_process_core(engine)
    owed = core is not None and core.scheduler.has_requests()
    return bool(engine.has_unfinished_requests() or owed)


class Engine:
    """One engine process of the pair, fed and read over pipes (``overlap``: under vLLM's
    async scheduling, ``cpu_async``)."""

    def __init__(
        self, model: str, role: str, store: str, hybrid: bool, log: str | None, overlap: bool
    ) -> None:
        env = dict(os.environ)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if log is not None:
            env["KVSCHED_VLLM_LOG"] = log
        cmd = [sys.executable, "-m", "kvsched.integrations.vllm.disagg", "engine", model]
        cmd += ["--role", role, "--store", store] + (["--hybrid"] if hybrid else [])
        cmd += ["--async-scheduling"] if overlap else []
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.out: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.out.put(json.loads(line))
        self.out.put(None)

    def send(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout_s: float) -> dict[str, Any]:
        got = self.out.get(timeout=timeout_s)
        if got is None:
            raise RuntimeError(f"engine exited with {self.proc.wait()}")
        if "error" in got:
            raise RuntimeError(f"engine refused request {got.get('id')!r}: {got['error']}")
        return got

    def close(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Close its input; its exit status and what it had left in flight at the end."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        left = None
        while (got := self.out.get(timeout=timeout_s)) is not None:
            left = got.get("left", left)
        return {"exit": self.proc.wait(timeout=timeout_s), "left": left}


class Proxy:
    """A prefill engine and a decode engine sharing ``store``; ``generate`` routes requests.
    ``overlap``: both engines under vLLM's async scheduling (``cpu_async``); ``ready``: what
    each engine said when it started (its batch queue size: 2 in vLLM's asynchronous loop)."""

    def __init__(
        self,
        model: str,
        store: str,
        hybrid: bool = False,
        logs: tuple[str, str] | None = None,
        overlap: bool = False,
    ) -> None:
        logs_or = logs or (None, None)
        self.prefill = Engine(model, "prefill", store, hybrid, logs_or[0], overlap)
        self.decode = Engine(model, "decode", store, hybrid, logs_or[1], overlap)
        self.ready = [engine.receive(timeout_s=600) for engine in (self.prefill, self.decode)]

    def generate(
        self, prompts: list[list[int]], max_tokens: int, timeout_s: float = 300
    ) -> list[dict[str, Any]]:
        """Each prompt prefilled by one engine and decoded by the other (all in flight at
        once); per prompt, the decode engine's result and the prefill engine's as
        ``"prefill"``."""
        for i, prompt in enumerate(prompts):
            self.prefill.send({"id": str(i), "prompt": prompt, "max_tokens": 1})
        prefilled: dict[str, dict[str, Any]] = {}
        for _ in prompts:  # (each decode starts as soon as its prefill is back)
            done = self.prefill.receive(timeout_s)
            prefilled[done["id"]] = done
            request = {
                "id": done["id"],
                "prompt": prompts[int(done["id"])],
                "max_tokens": max_tokens,
                "kv_transfer_params": done["kv_transfer_params"],
            }
            self.decode.send(request)
        decoded = [self.decode.receive(timeout_s) for _ in prompts]
        out = sorted(decoded, key=lambda d: int(d["id"]))
        return [{**d, "prefill": prefilled[d["id"]]} for d in out]

    def close(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.prefill.close(), self.decode.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsched.integrations.vllm.disagg")
    sub = parser.add_subparsers(dest="command", required=True)
    engine = sub.add_parser("engine", help="one engine of the pair, requests on stdin")
    engine.add_argument("model")
    engine.add_argument("--role", choices=sorted(ROLES), required=True)
    engine.add_argument("--store", required=True, help="dir:PATH or mooncake:HOST:PORT")
    engine.add_argument("--hybrid", action="store_true", help="a hybrid model's settings")
    engine.add_argument(
        "--async-scheduling",
        action="store_true",
        help="vLLM's async scheduling (kept on for vLLM's CPU build: cpu_async.py)",
    )
    args = parser.parse_args(argv)
    kw = engine_args(args.model, args.role, args.store, args.hybrid)
    if args.async_scheduling:
        from kvsched.integrations.vllm.cpu_async import keep_async_scheduling_on_cpu

        keep_async_scheduling_on_cpu()
        kw["async_scheduling"] = True
    serve(kw, sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
