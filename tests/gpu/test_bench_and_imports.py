"""The torch benchmark runs (tiny sizes), and ``kvsched.gpu`` imports without torch."""

from __future__ import annotations

import subprocess
import sys

from kvsched.gpu.bench_torch import run_bench


def test_bench_torch_smoke() -> None:
    res = run_bench(
        prompt_len=256,
        hit_tokens=128,
        chunk=128,
        block_size=16,
        decode_batches=(1, 3),
        decode_context=20,
        decode_steps=2,
        repeats=1,
    )
    assert res["prefill_tok_s"] > 0 and set(res["decode_tok_s"]) == {1, 3}
    assert res["hit"]["warm_s"] > 0 and res["hit"]["cold_s"] > 0


def test_gpu_package_imports_torch_lazily() -> None:
    code = (
        "import sys, kvsched.gpu as g; g.SimulatedExecutor; g.CostModel; "
        "assert 'torch' not in sys.modules, 'kvsched.gpu imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    import kvsched.gpu as g
    from kvsched.gpu.torch_executor import TorchExecutor

    assert g.TorchExecutor is TorchExecutor
