"""`kvsched demo --executor torch` runs the real hybrid model and reports compute saved."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvsched.cli import main


def test_the_torch_demo_reports_tokens_computed_against_tokens_served(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["demo", "--executor", "torch", "--sessions", "3", "--turns", "2",
                 "--quiet", "--json"])
    assert code == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["finished"] == 6
    assert metrics["hit_rate_checkpoint"] > 0  # multi-turn prompts restore checkpoints
    assert metrics["prefill_tokens"] < metrics["prompt_tokens"]
    assert metrics["wall_time_s"] > 0


def test_the_torch_demo_fails_clearly_on_a_missing_model(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:  # type: ignore[no-untyped-def]
    code = main(["demo", "--executor", "torch", "--model", str(tmp_path / "nope"), "--quiet"])
    assert code == 2
    assert "cannot read" in capsys.readouterr().err
