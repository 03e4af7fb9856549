#!/usr/bin/env bash
# Build (or refresh) the second environment the vLLM integration is tested in:
#   scripts/vllm_env.sh [DIR]            (default .venv-vllm; prints the python to use)
# vLLM 0.32.0 pins transformers < 5.20, the torch oracle tests pin transformers 5.24.0: the two
# cannot share one environment, so vLLM gets its own, with exactly its own pins
# (`kvsched[vllm]`). Its resolver also pulls CUDA builds of torchvision / torchaudio /
# torchcodec (importing transformers' model modules then fails: `torchvision::nms does not
# exist`) and triton (no CPU backend); they are removed — nothing on the CPU path uses them.
# Progress goes to stderr, one line per step; stdout is only the python's path.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.venv-vllm}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
say() { echo "vllm_env: $*" >&2; }
say "building $dir (about 2 minutes on a fresh clone)..."
if [ ! -x "$dir/bin/python" ]; then
    say "1/4 creating the virtual environment"
    python3 -m venv "$dir"
else
    say "1/4 reusing the virtual environment"
fi
py="$dir/bin/python"
say "2/4 installing kvsched[vllm,vllm-test] and vLLM's pins (the long step)"
"$py" -m pip install -q -e '.[vllm,vllm-test]' >&2
say "3/4 removing torchvision, torchaudio, torchcodec, triton (CUDA-only)"
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec triton >&2 2>/dev/null || true
say "4/4 checking that vllm and kvsched.integrations.vllm import"
"$py" -c 'import vllm, kvsched.integrations.vllm' >&2
say "done: $py"
echo "$py"
