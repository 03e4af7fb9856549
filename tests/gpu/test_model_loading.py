"""Loading a checkpoint directory: one that does not fit the model its config.json describes
(another architecture, other shapes, missing or unexpected tensors) is a one-line error naming
what was expected and what was found, not torch's multi-line ``state_dict`` error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import kvsched.cli
from kvsched.gpu.model import CheckpointMismatch, HybridModel


def _copy(tiny_dir: Path, tmp_path: Path, **config: object) -> Path:
    path = tmp_path / "model"
    shutil.copytree(tiny_dir, path)
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, **config}))
    return path


def test_a_checkpoint_of_other_shapes_is_one_line_naming_expected_and_found(
    tiny_dir: Path, tmp_path: Path
) -> None:
    path = _copy(tiny_dir, tmp_path, hidden_size=128)
    with pytest.raises(CheckpointMismatch) as info:
        HybridModel.from_pretrained(path)
    message = str(info.value)
    assert "\n" not in message
    assert f"{path} is not a checkpoint of the Qwen3.5-style hybrid" in message
    assert "found 'qwen3_5_text' ['Qwen3_5ForCausalLM']" in message
    assert "tensors of another shape (e.g. model.embed_tokens.weight (512, 64) instead of " in (
        message
    )


def test_a_checkpoint_with_missing_and_unexpected_tensors_names_some_of_each(
    tiny_dir: Path, tmp_path: Path
) -> None:
    path = _copy(tiny_dir, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.9.mlp.up_proj.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointMismatch) as info:
        HybridModel.from_pretrained(path)
    message = str(info.value)
    assert "\n" not in message
    assert "1 tensors missing (e.g. model.norm.weight)" in message
    assert "1 unexpected tensors (e.g. model.layers.9.mlp.up_proj.weight)" in message


def test_a_config_json_of_another_architecture_names_the_missing_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 9}))
    with pytest.raises(ValueError, match=r"config.json has no 'num_hidden_layers': .*'bert'"):
        HybridModel.from_pretrained(tmp_path)


def test_demo_with_a_mismatched_torch_checkpoint_is_one_error_line(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _copy(tiny_dir, tmp_path, hidden_size=128)
    argv = ["demo", "--executor", "torch", "--model", str(path), "--sessions", "1", "--quiet"]
    code = kvsched.cli.main(argv)
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("kvsched: error: --executor torch: cannot start the torch executor: ")
    assert err.count("\n") == 1 and "instead of" in err
