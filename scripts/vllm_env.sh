#!/usr/bin/env bash
# Build (or refresh) the second environment the vLLM integration is tested in:
#   scripts/vllm_env.sh [DIR]            (default .venv-vllm; prints the python to use)
# vLLM 0.32.0 pins transformers < 5.20, the torch oracle tests pin transformers 5.24.0: the two
# cannot share one environment, so vLLM gets its own, with exactly its own pins
# (`kvsched[vllm]`). Its resolver also pulls CUDA builds of torchvision / torchaudio /
# torchcodec (importing transformers' model modules then fails: `torchvision::nms does not
# exist`) and triton (no CPU backend); they are removed — nothing on the CPU path uses them.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.venv-vllm}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$dir/bin/python" ] || python3 -m venv "$dir"
py="$dir/bin/python"
"$py" -m pip install -q -e '.[vllm,vllm-test]' >&2
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec triton >&2 2>/dev/null || true
"$py" -c 'import vllm, kvsched.integrations.vllm' >&2
echo "$py"
