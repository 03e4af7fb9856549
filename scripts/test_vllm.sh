#!/usr/bin/env bash
# The vLLM integration tests (`pytest -k vllm`) in their own environment (scripts/vllm_env.sh:
# vLLM's transformers pin conflicts with the oracle tests'). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
py="$(scripts/vllm_env.sh 2> >(grep -v 'is ignored: it is neither' >&2))"
exec "$py" -m pytest -k vllm "$@"
