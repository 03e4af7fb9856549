#!/usr/bin/env bash
# Side-by-side with lmdeploy 0.18.0's prefix match, same run, same machine:
#   benchmarks/compare_lmdeploy.sh [--mode ar|ssm] [--rounds R] [SHAPE ...]   SHAPE = BATCHxCONTEXT
# Default: --mode ar, 1 round, shapes 128x65536 512x131072. For each shape and round it runs
# lmdeploy's BlockTrie.match() (../shared/bench/lmdeploy/run.sh), `kvsched bench match` (the
# match alone: block identities computed at arrival, outside its timed scope) and
# `kvsched bench admit` (one Engine.step admitting the same requests: identity and everything
# else included), back to back, prints the three JSON lines, then one summary line per shape
# and round with both p50 ratios (lmdeploy / kvsched: above 1, kvsched is faster).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
anchor=${LMDEPLOY_ANCHOR:-$here/../../shared/bench/lmdeploy/run.sh}
mode=ar
rounds=1
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) mode=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) break ;;
  esac
done
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(128x65536 512x131072)
[ -x "$anchor" ] || { echo "lmdeploy anchor not found: $anchor (set LMDEPLOY_ANCHOR)" >&2; exit 2; }
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
for round in $(seq 1 "$rounds"); do
  for shape in "${shapes[@]}"; do
    b=${shape%x*}; l=${shape#*x}
    theirs=$("$anchor" --mode "$mode" --batch "$b" --context "$l")
    match=$(kvsched bench match --mode "$mode" --batch "$b" --context "$l" --json)
    admit=$(kvsched bench admit --mode "$mode" --batch "$b" --context "$l" --json)
    echo "$theirs"
    echo "$match"
    echo "$admit"
    python3 - "$round" "$theirs" "$match" "$admit" <<'PY'
import json, sys
r = sys.argv[1]
t, m, a = (json.loads(x) for x in sys.argv[2:])
print(f"round {r} {a['mode']} {a['batch']}x{a['context']}: lmdeploy match p50 {t['p50_ms']} ms | "
      f"kvsched match {m['p50_ms']} ms ({t['p50_ms'] / m['p50_ms']:.1f}x) | "
      f"kvsched admit, end to end {a['p50_ms']} ms ({t['p50_ms'] / a['p50_ms']:.2f}x)")
PY
  done
done
