"""The opt-in prefix-sharing model of Azure traces (--sharing code-edit): arrivals and lengths
kept, tokens assigned by a seeded model; the default shares nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvsched.cli
from kvsched.replay.shapes import ShapeError
from kvsched.replay.sharing import CodeEdit, code_edit_prompts, sharing_model
from kvsched.replay.traces import read_azure

LENGTHS = [int(x) for x in np.random.default_rng(5).integers(50, 3000, 300)]


def _azure(path: Path, n: int = 120) -> Path:
    rng = np.random.default_rng(9)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        rows.append(f"2023-11-16 18:17:{i // 10:02d}.{i % 10}000000,{rng.integers(30, 2500)},9")
    path.write_text("\n".join(rows) + "\n")
    return path


def _shared_pairs(prompts: list[np.ndarray], tokens: int) -> int:
    return sum(
        any(
            len(p) > tokens and len(q) > tokens and np.array_equal(p[:tokens], q[:tokens])
            for q in prompts[:i]
        )
        for i, p in enumerate(prompts)
    )


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    a, b, c = (code_edit_prompts(CodeEdit(), LENGTHS, s) for s in (1, 1, 2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_prompts_keep_the_trace_lengths():
    prompts = code_edit_prompts(CodeEdit(), LENGTHS, 0)
    assert [len(p) for p in prompts] == LENGTHS


def test_a_users_next_request_in_the_same_file_shares_past_the_repository_context():
    model = CodeEdit(users=4, repos=1, repo_tokens=256, same_file_p=1.0)
    prompts = code_edit_prompts(model, LENGTHS, 0)
    assert _shared_pairs(prompts, 256 + 64) > 100


def test_without_repository_context_or_same_file_requests_share_nothing():
    model = CodeEdit(repo_tokens=0, same_file_p=0.0)
    prompts = code_edit_prompts(model, LENGTHS, 0)
    assert _shared_pairs(prompts, 16) == 0


def test_azure_with_sharing_keeps_arrivals_and_lengths_and_has_an_ideal(tmp_path: Path):
    path = _azure(tmp_path / "a.csv")
    plain, shared = read_azure(path), read_azure(path, sharing=CodeEdit(users=8))
    assert plain.info.ideal_hit_rate == 0.0
    assert (shared.info.ideal_hit_rate or 0) > 0.2
    for x, y in zip(plain.workload.turns, shared.workload.turns, strict=True):
        assert x.arrival_s == y.arrival_s
        assert len(x.request.prompt) == len(y.request.prompt)
        assert x.request.max_tokens == y.request.max_tokens


def test_a_bad_sharing_model_or_parameter_is_an_error_naming_it():
    with pytest.raises(ShapeError, match="--sharing 'git'"):
        sharing_model("git", None, 100)
    with pytest.raises(ShapeError, match="same_file_p"):
        sharing_model("code-edit", "same_file_p=2", 100)
    assert sharing_model("none", None, 100) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sharing", "code-edit", "--shape-param", "users=0"], "--shape-param: users must"),
        (["--shape-param", "users=3"], "--shape-param sets a sharing model's parameters"),
    ],
)
def test_cli_refuses_bad_sharing_options_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
):
    path = _azure(tmp_path / "a.csv", 5)
    assert kvsched.cli.main(["replay", str(path), *args, "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_sharing_for_a_trace_that_is_not_azure(capsys: pytest.CaptureFixture[str]):
    assert kvsched.cli.main(["replay", "gen:chat-branching", "--sharing", "code-edit"]) == 2
    assert "--sharing code-edit: a sharing model applies to Azure traces only" in (
        capsys.readouterr().err
    )
