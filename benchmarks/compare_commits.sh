#!/usr/bin/env bash
# Same-run comparison of the hot-path benchmarks between a git revision and the working tree:
#   benchmarks/compare_commits.sh REV [ROUNDS]
# Runs `kvsched bench match` (ar and ssm, 128 x 65,536) and `kvsched bench step` (1,024
# running) alternately for REV (checked out in a temporary worktree) and for this tree,
# ROUNDS times (default 3), and prints one JSON line per run. Quote the ratios of the same
# round: the machine is shared and absolute times drift.
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: $0 REV [ROUNDS]}"
rounds="${2:-3}"
base="$(mktemp -d)/base"
git worktree add -q --detach "$base" "$rev"
trap 'git worktree remove --force "$base"' EXIT
benches=(
  "match --mode ar --batch 128 --context 65536"
  "match --mode ssm --batch 128 --context 65536"
  "step --running 1024"
)
for round in $(seq 1 "$rounds"); do
  for bench in "${benches[@]}"; do
    for side in base head; do
      src="$PWD/src"; [ "$side" = base ] && src="$base/src"
      # shellcheck disable=SC2086
      out="$(PYTHONPATH="$src" python3 -m kvsched.cli bench $bench --json)"
      echo "{\"round\": $round, \"side\": \"$side\", \"rev\": \"$([ "$side" = base ] && echo "$rev" || echo working-tree)\", \"result\": $out}"
    done
  done
done
