#!/usr/bin/env bash
# sweep_policies.sh OUT [JOBS] [LIMIT]: the checkpoint-policy sweep of issue 26 on three
# traffic shapes, written to OUT: per shape a report directory (sweep.json, sweep.md,
# sweep.png, one directory per point) and its printed table; OUT/tables.md gathers the
# markdown tables. Every shape: --hybrid, block size 64, unbounded KV, every checkpoint
# policy and the oracle (--policies all), budgets 64 / 256 / 1,024 / unbounded states and
# two byte budgets (16 GiB and 64 GiB: about 222 and 889 states of 73.7 MiB, between the
# count budgets). JOBS: sweep points run in parallel (default: the number of CPUs); LIMIT:
# only the first LIMIT requests of each shape (a quick check; default: all of them).
# Shapes (docs/replay.md): the Mooncake synthetic trace; the Azure code trace with the
# code-edit sharing model (seed 0); gen:chat-branching (seed 0). Traces: ../shared/traces
# or ../../shared/traces (TRACES=DIR to change). SHAPES="chat-branching azure-code" runs only
# the shapes named (default: all three, in the order above). Run from the repository root; progress: one line per point.
set -euo pipefail
OUT=${1:?usage: scripts/sweep_policies.sh OUT [JOBS] [LIMIT]}
JOBS=${2:-$(nproc)}
LIMIT=${3:-}
if [ -z "${TRACES:-}" ]; then  # ../shared/traces from a main checkout, ../../ from a worktree
  for TRACES in ../shared/traces ../../shared/traces; do [ -d "$TRACES" ] && break; done
fi
KVSCHED=${KVSCHED:-"python3 -m kvsched.cli"}
export PYTHONPATH=${PYTHONPATH:-src}
mkdir -p "$OUT"

COMMON=(--hybrid --block-size 64 --policies all
        --sweep checkpoint-budget=64,256,1024,unbounded --sweep checkpoint-memory=16GiB,64GiB
        --jobs "$JOBS" --overwrite)
[ -n "$LIMIT" ] && COMMON+=(--limit "$LIMIT")

shape() {  # shape NAME TRACE [OPTIONS...]
  local name=$1 trace=$2; shift 2
  echo "[$(date -u +%T)] $name: $trace $* (jobs $JOBS${LIMIT:+, first $LIMIT requests})" >&2
  local start=$SECONDS
  # shellcheck disable=SC2086
  $KVSCHED replay "$trace" "$@" "${COMMON[@]}" --report "$OUT/$name" > "$OUT/$name.txt"
  echo "[$(date -u +%T)] $name: done in $((SECONDS - start)) s" >&2
}

SHAPES=${SHAPES:-synthetic azure-code chat-branching}
for name in $SHAPES; do
  case $name in
    synthetic) shape synthetic "$TRACES/mooncake_fast25_synthetic_trace.jsonl" ;;
    azure-code) shape azure-code "$TRACES/azure2023_AzureLLMInferenceTrace_code.csv" \
                  --sharing code-edit --seed 0 ;;
    chat-branching) shape chat-branching gen:chat-branching --seed 0 ;;
    *) echo "sweep_policies.sh: unknown shape $name (synthetic, azure-code, chat-branching)" >&2
       exit 2 ;;
  esac
done

{
  echo "# Checkpoint policies on three traffic shapes"
  echo
  echo "Command: scripts/sweep_policies.sh $OUT $JOBS $LIMIT ($(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  for name in $SHAPES; do
    echo
    sed "1s/^### .*/### $name/" "$OUT/$name/sweep.md"
    echo
    echo "![$name: hit rate and TTFT per checkpoint budget, one line per policy]($name/sweep.png)"
  done
} > "$OUT/tables.md"
echo "tables: $OUT/tables.md" >&2
