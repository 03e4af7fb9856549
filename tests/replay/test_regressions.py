"""Failures found by long property runs, kept as explicit cases."""

import os
import tempfile

import numpy as np
from tests.replay.test_verify import record_run

from kvsched.config import ModelSpec, SchedulerConfig
from kvsched.events import types as ev
from kvsched.replay.verify import verify_log


def test_a_sequence_readmitted_after_drain_and_wake_registers_into_a_fresh_path() -> None:
    # Found by HYPOTHESIS_PROFILE=deep: a drained sequence kept the read-only prefix view it
    # had been admitted with, and registering its blocks after wake wrote into it.
    config = SchedulerConfig(
        model=ModelSpec(vocab_size=64, max_context=256),
        block_size=4,
        num_blocks=8,
        max_batch=1,
        max_prefill_tokens=4,
    )
    prompt = np.zeros(5, dtype=np.int32)
    schedule = {
        1: [ev.RequestArrived(i, prompt, 2 if i == 1 else 1) for i in range(5)],
        4: [ev.DrainRequested()],
        5: [ev.WakeRequested()],
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.kvlog")
        record_run(path, config, schedule)
        assert verify_log(path).divergence is None
