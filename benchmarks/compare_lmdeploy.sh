#!/usr/bin/env bash
# Side-by-side prefix-match benchmark: kvsched and lmdeploy 0.18.0 in the same run, same machine.
# Usage: benchmarks/compare_lmdeploy.sh [--mode ar] [SHAPE ...]   SHAPE = BATCHxCONTEXT
# Default shapes: 128x65536 512x131072. Prints both JSON lines per shape and the p50 ratio.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
anchor=${LMDEPLOY_ANCHOR:-$here/../../shared/bench/lmdeploy/run.sh}
mode=ar
if [ "${1:-}" = "--mode" ]; then mode=$2; shift 2; fi
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(128x65536 512x131072)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
for shape in "${shapes[@]}"; do
  b=${shape%x*}; l=${shape#*x}
  ours=$(kvsched bench match --mode "$mode" --batch "$b" --context "$l" --json)
  theirs=$("$anchor" --mode "$mode" --batch "$b" --context "$l")
  echo "$ours"
  echo "$theirs"
  python3 - "$ours" "$theirs" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"{a['mode']} {a['batch']}x{a['context']}: kvsched p50 {a['p50_ms']} ms, "
      f"lmdeploy p50 {b['p50_ms']} ms, speed-up {b['p50_ms'] / a['p50_ms']:.0f}x")
PY
done
