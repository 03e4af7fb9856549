#!/usr/bin/env bash
# Side-by-side with lmdeploy 0.18.0's prefix match, same run, same machine:
#   benchmarks/compare_lmdeploy.sh [--mode ar|ssm] [--rounds R] [--interleave] [--warmup W]
#                                  [--samples N] [SHAPE ...]   SHAPE = BATCHxCONTEXT
# Default: --mode ar, 1 round, shapes 128x65536 512x131072. For each shape and round it runs
# lmdeploy's BlockTrie.match() (../shared/bench/lmdeploy/run.sh), `kvsched bench match` (the
# match alone: block identities computed at arrival, outside its timed scope) and
# `kvsched bench admit` (one Engine.step admitting the same requests: identity and everything
# else included), back to back, prints the three JSON lines, then one summary line per shape
# and round with both p50 ratios (lmdeploy / kvsched: above 1, kvsched is faster).
# With --interleave it runs benchmarks/interleave.py instead (lmdeploy's match and
# `kvsched bench admit`'s step in two processes, their samples alternated one by one, so that
# both see the same machine: its speed drifts by up to 1.6x over seconds; default 20 samples),
# prints its JSON line, then one summary line per shape and round with the end-to-end ratio
# as the ratio of the p50s and as the median of the pairs' own ratios.
# --warmup and --samples are passed on to every benchmark (default: each one's own).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
anchor=${LMDEPLOY_ANCHOR:-$here/../../shared/bench/lmdeploy/run.sh}
mode=ar
rounds=1
interleave=0
counts=()
while [ $# -gt 0 ]; do
  case "$1" in
    --mode) mode=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --interleave) interleave=1; shift ;;
    --warmup|--samples) counts+=("$1" "$2"); shift 2 ;;
    *) break ;;
  esac
done
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(128x65536 512x131072)
[ -x "$anchor" ] || { echo "lmdeploy anchor not found: $anchor (set LMDEPLOY_ANCHOR)" >&2; exit 2; }
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
if [ "$interleave" = 1 ]; then
  for round in $(seq 1 "$rounds"); do
    for shape in "${shapes[@]}"; do
      b=${shape%x*}; l=${shape#*x}
      out=$(LMDEPLOY_ANCHOR="$anchor" python3 "$here/interleave.py" --what admit --mode "$mode" \
        --batch "$b" --context "$l" ${counts[@]+"${counts[@]}"})
      echo "$out"
      python3 - "$round" "$out" <<'PY'
import json, sys
r = sys.argv[1]
o = json.loads(sys.argv[2])
t, a = o["lmdeploy"], o["kvsched"]
print(f"round {r} {o['mode']} {o['batch']}x{o['context']} interleaved, {o['samples']} pairs: "
      f"lmdeploy match p50 {t['p50_ms']} ms | kvsched admit, end to end {a['p50_ms']} ms | "
      f"ratio of p50s {o['ratio_p50']:.2f}x, median of pair ratios {o['ratio_pairs_p50']:.2f}x")
PY
    done
  done
  exit 0
fi
for round in $(seq 1 "$rounds"); do
  for shape in "${shapes[@]}"; do
    b=${shape%x*}; l=${shape#*x}
    theirs=$("$anchor" --mode "$mode" --batch "$b" --context "$l" ${counts[@]+"${counts[@]}"})
    match=$(kvsched bench match --mode "$mode" --batch "$b" --context "$l" \
      ${counts[@]+"${counts[@]}"} --json)
    admit=$(kvsched bench admit --mode "$mode" --batch "$b" --context "$l" \
      ${counts[@]+"${counts[@]}"} --json)
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
