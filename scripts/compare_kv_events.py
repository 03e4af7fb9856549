"""Compare vLLM's own KV-event stream with kvsched's for one hybrid workload (needs vLLM).

    PYTHONPATH=src .venv-vllm/bin/python scripts/compare_kv_events.py OUT_DIR [BLOCKS]

Builds the tiny Qwen3-Next, runs the hybrid ``mixed`` workload once under each scheduler
with ``kv_events_config`` publishing over loopback ZeroMQ, decodes every batch with vLLM's
``KVEventBatch`` and prints, per scheduler: each group's kind, event counts by kind, the
(token_ids, block_hashes, block_size) lengths of the mamba stores, the requests' cached
tokens; then which state and attention names both streams stored (docs/vllm.md, "KV events
for hybrid models"; kvsched's group 0 carries its checkpoints as chains).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvsched.integrations.vllm.listen import Listener


def stream(model: Path, out: Path, scheduler: str, blocks: str) -> list[bytes]:
    """The payloads one run under ``scheduler`` publishes."""
    with Listener() as listener:
        args = ["--model", str(model), "--out", str(out), "--scheduler", scheduler, "--hybrid"]
        args += ["--workload", "mixed", "--blocks", blocks, "--batched-tokens", "2048"]
        args += ["--max-model-len", "4096", "--kv-events", listener.endpoint]
        cmd = [sys.executable, "-m", "kvsched.integrations.vllm.run", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return [payload for _, payload in listener.messages]


def fold(payloads: list[bytes]) -> tuple[dict[int, str], dict[str, Any], dict[int, set[int]]]:
    """(kind per group, counts, every name each group ever stored)."""
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    kinds: dict[int, str] = {}
    counts: dict[str, Any] = {"mamba store lengths": []}
    stored: dict[int, set[int]] = {}
    for payload in payloads:
        for e in decoder.decode(payload).events:
            if isinstance(e, BlockStored):
                kinds[e.group_idx] = e.kv_cache_spec_kind
                stored.setdefault(e.group_idx, set()).update(e.block_hashes)
                key = f"stored {e.kv_cache_spec_kind}"
                if e.kv_cache_spec_kind == "mamba":
                    lengths = (len(e.token_ids), len(e.block_hashes), e.block_size)
                    counts["mamba store lengths"].append(lengths)
            elif isinstance(e, BlockRemoved):
                key = f"removed {kinds.get(e.group_idx)}"
            else:
                key = "cleared"
            counts[key] = counts.get(key, 0) + 1
    return kinds, counts, stored


def main(argv: list[str]) -> int:
    from kvsched.integrations.vllm.models import build

    out = Path(argv[0])
    blocks = argv[1] if len(argv) > 1 else "33"
    model = build("qwen3-next", out / "model")
    names: dict[str, tuple[set[int], set[int]]] = {}
    for scheduler in ("vllm", "kvsched"):
        kinds, counts, stored = fold(stream(model, out / f"{scheduler}.json", scheduler, blocks))
        requests = json.loads((out / f"{scheduler}.json").read_text())["requests"]
        print(scheduler, "groups", kinds)
        print(scheduler, "counts", counts)
        print(scheduler, "cached tokens", {n: r["cached"] for n, r in requests.items()})
        attention = set().union(*(stored[g] for g, k in kinds.items() if k == "full_attention"))
        # group 0, which vllm-router scores, holds kvsched's checkpoints as chains (every
        # block from the first): the state names are those of the other mamba groups
        mamba = sorted(g for g, k in kinds.items() if k == "mamba")
        states = [stored[g] for g in mamba if g != 0 or len(mamba) == 1]
        same = all(s == states[0] for s in states)
        print(scheduler, f"{len(states[0])} state names; the same in mamba groups 1+: {same};")
        print(scheduler, f"every state name an attention name: {states[0] <= attention}")
        if 0 in mamba and len(mamba) > 1:
            covers = states[0] <= stored[0]
            print(scheduler, f"group 0: {len(stored[0])} names, all states among them: {covers}")
        names[scheduler] = (attention, states[0])
    for i, what in enumerate(("attention", "state")):
        v, k = names["vllm"][i], names["kvsched"][i]
        print(f"{what} names: both {len(v & k)}, vLLM only {len(v - k)}, kvsched only {len(k - v)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
