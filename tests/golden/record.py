"""Records the golden event logs of schema version 2 (run once, by the release that
introduced the versioned schema; the logs are committed and never re-recorded).

    python3 -m tests.golden.record        # writes tests/golden/schema2-*.kvlog

Two scripted runs with a fake external store (it answers lookups, then finishes or fails
loads and confirms saves a step later), between them using every event type of the schema:
an attention model with sessions (holds, aborts, a deferred abort during a load, a failed
load), and a hybrid model (checkpoints published, pinned, evicted, abandoned after a failed
step, released at a drain).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.engine import Engine, create_log
from kvsched.events import types as ev
from kvsched.gpu.sim import SimulatedExecutor
from kvsched.statemachines import LoadState

HERE = Path(__file__).resolve().parent
VOCAB = 97


def _config(hybrid: bool) -> SchedulerConfig:
    # (the rules schema 2 ran: lmdeploy's, "decode" included; from_log_header pins them)
    return SchedulerConfig.from_log_header(
        dict(
            model=ModelSpec(vocab_size=VOCAB, max_context=256),
            block_size=4,
            num_blocks=28,
            max_batch=3,
            max_prefill_tokens=8,
            hybrid=hybrid,
            checkpoint_budget=3,
            decode_checkpoint_interval=4 if hybrid else 0,
            external_kv=True,
        ),
        2,
    )


class _Store:
    """Owes the engine an answer for every lookup, load and save: answered next step."""

    def __init__(self) -> None:
        self.fail_next_load = False

    def reports(self, engine: Engine) -> list[ev.Event]:
        out: list[ev.Event] = []
        transfers = engine.state.transfers
        for seq_id, load in sorted(transfers.loads.items()):
            if load.state == LoadState.LOOKUP_PENDING:
                out.append(ev.KVLookupAnswered(seq_id, load.num_blocks))
            elif load.in_flight:
                if self.fail_next_load:
                    self.fail_next_load = False
                    out.append(ev.KVLoadFailed(seq_id, len(load.blocks) // 2, "store failed"))
                else:
                    out.append(ev.KVLoadFinished(seq_id))
        out += [ev.KVSaveFinished(s, ok=s % 5 != 3) for s in sorted(transfers.leases)]
        return out


def _prompt(rng: np.random.Generator, prefix: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([prefix, rng.integers(1, VOCAB, n, dtype=np.int32)]).astype(np.int32)


def record(path: Path, hybrid: bool) -> Engine:
    config = _config(hybrid)
    log = create_log(str(path), config)
    engine = Engine(config, log=log, check_invariants=True)
    executor = SimulatedExecutor(VOCAB)
    store = _Store()
    rng = np.random.default_rng(2 if hybrid else 1)
    prefix = rng.integers(1, VOCAB, 12, dtype=np.int32)
    outcome: list[ev.Event] = []
    next_id, deferred, failures = 0, 0, 0
    for step in range(220):
        reports = store.reports(engine)
        inputs: list[ev.Event] = list(outcome)
        if step % 6 == 0 and step < 150:
            session = next_id % 3 if next_id % 2 else -1
            prompt = _prompt(rng, prefix, int(rng.integers(1, 14)))
            max_tokens = int(rng.integers(2, 9))
            inputs.append(
                ev.RequestArrived(
                    next_id, prompt, max_tokens, arrival_time=float(step), session_id=session
                )
            )
            next_id += 1
        if step == 7:
            inputs.append(ev.RequestArrived(90, np.zeros(0, np.int32), 4))  # rejected
        if step in (69, 139):  # its lookup is still pending when the drain comes
            tail = rng.integers(1, VOCAB, 20, dtype=np.int32)
            inputs.append(ev.RequestArrived(100 + step, _prompt(rng, prefix, 0)[:4], 3))
            inputs.append(ev.RequestArrived(200 + step, _prompt(rng, tail, 4), 3))
        loading = [s for s, ld in engine.state.transfers.loads.items() if ld.in_flight]
        if loading and deferred < 2:  # abort a sequence whose KV is loading: deferred
            inputs.append(ev.RequestAborted(loading[0], "client abort"))
            reports = [r for r in reports if getattr(r, "seq_id", None) != loading[0]]
            deferred += 1
        running = engine.state.seqs.running_rows().tolist()
        if step in (33, 101) and running:
            victim = int(engine.state.seqs.row_seq[running[-1]])
            inputs.append(ev.RequestAborted(victim, "client abort"))
        if step == 50:
            store.fail_next_load = True
        if step in (70, 140):
            inputs.append(ev.DrainRequested())
            reports = []  # lookups still pending are cancelled, loads in flight defer it
        if step in (74, 144):
            inputs.append(ev.WakeRequested())
        if step == 160:
            inputs += [ev.SessionEnded(s) for s in range(3)]
        result = engine.step([*inputs, *reports], float(step))
        saved_state = any(isinstance(d, ev.CheckpointReserved) for d in result.decisions)
        if result.plan.is_empty:
            outcome = []
        elif failures < 2 and (saved_state or not hybrid) and 40 < step < 60:
            outcome = [ev.StepFailed(result.plan.step, "injected device error")]
            failures += 1
        else:
            outcome = [executor.execute(result.plan)]
    log.close()
    return engine


def main() -> None:
    for hybrid in (False, True):
        path = HERE / f"schema2-{'hybrid' if hybrid else 'attention'}.kvlog"
        record(path, hybrid)
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
