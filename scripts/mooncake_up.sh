#!/usr/bin/env bash
# Usage: scripts/mooncake_up.sh [--netns] CMD...
# Start a loopback-only Mooncake Store (mooncake_master + a standalone mooncake_client memory
# holder), wait until the holder's segment is mounted, run CMD with MOONCAKE_MASTER (and
# MOONCAKE_METADATA, MOONCAKE_METRICS) exported, tear everything down by PID, exit with CMD's
# exit code. --netns: first re-execute inside a private network namespace (unshare -rn, lo up),
# because Mooncake's clients open listeners on 0.0.0.0 that no flag confines.
# Env: PYTHON (default python3), MC_SEGMENT (holder segment, default 1GB).
set -euo pipefail
if [ "${1:-}" = "--netns" ]; then
  shift
  exec unshare -rn sh -c 'ip link set lo up && exec "$0" "$@"' "$0" "$@"
fi
[ $# -gt 0 ] || { echo "usage: $0 [--netns] CMD..." >&2; exit 2; }
PY=${PYTHON:-python3}
PKG=$("$PY" -c 'import importlib.util as u, os; s = u.find_spec("mooncake"); print(os.path.dirname(s.origin) if s and s.origin else "")')
[ -n "$PKG" ] && [ -x "$PKG/mooncake_master" ] ||
  { echo "mooncake-transfer-engine-non-cuda is not installed for $PY" >&2; exit 1; }
RUN=$(mktemp -d "${TMPDIR:-/tmp}/mooncake_up.XXXXXX")
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
http_get() { "$PY" -c 'import sys, urllib.request as r
try: print(r.urlopen(sys.argv[1], timeout=0.5).read().decode())
except OSError: pass' "$1"; }
listening() { "$PY" -c 'import socket, sys; s = socket.socket(); s.settimeout(0.2); sys.exit(s.connect_ex(("127.0.0.1", int(sys.argv[1]))))' "$1"; }
RPC_PORT=$(free_port); METRICS_PORT=$(free_port); HOLDER_PORT=$(free_port)
export MC_LOG_LEVEL=${MC_LOG_LEVEL:-WARNING}
export MC_STORE_CLIENT_SETUP_RETRIES=${MC_STORE_CLIENT_SETUP_RETRIES:-2}
export MC_TCP_BIND_ADDRESS=127.0.0.1
PIDS=""
cleanup() {  # TERM everything we started, poll <= 5 s, then KILL, reap, remove the run dir
  if [ -n "$PIDS" ]; then
    kill -TERM $PIDS 2>/dev/null || true
    for _ in $(seq 1 100); do
      alive=""; for p in $PIDS; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ -z "$alive" ] && break; sleep 0.05
    done
    kill -KILL $PIDS 2>/dev/null || true
    wait $PIDS 2>/dev/null || true
  fi
  rm -rf "$RUN"
}
trap cleanup EXIT
trap 'exit 143' TERM; trap 'exit 130' INT
"$PKG/mooncake_master" --rpc_address=127.0.0.1 --rpc_port="$RPC_PORT" \
  --metrics_host=127.0.0.1 --metrics_port="$METRICS_PORT" \
  --default_kv_lease_ttl=200 --client_ttl=3 \
  --minloglevel=1 --enable_metric_reporting=false >"$RUN/master.log" 2>&1 &
MASTER_PID=$!; PIDS="$MASTER_PID"
for i in $(seq 1 200); do  # <= 10 s; the master exits rc=1 silently if its port is taken
  kill -0 "$MASTER_PID" 2>/dev/null || { echo "mooncake_master died" >&2; cat "$RUN/master.log" >&2; exit 1; }
  http_get "http://127.0.0.1:$METRICS_PORT/health" | grep -q '"service_ready":true' &&
    listening "$RPC_PORT" && break
  [ "$i" = 200 ] && { echo "mooncake_master not ready" >&2; cat "$RUN/master.log" >&2; exit 1; }
  sleep 0.05
done
"$PKG/mooncake_client" --host=127.0.0.1 --port="$HOLDER_PORT" \
  --global_segment_size="${MC_SEGMENT:-1GB}" --local_buffer_size=0 \
  --master_server_address="127.0.0.1:$RPC_PORT" --metadata_server=P2PHANDSHAKE \
  --protocol=tcp >"$RUN/holder.log" 2>&1 &
HOLDER_PID=$!; PIDS="$HOLDER_PID $MASTER_PID"
for i in $(seq 1 200); do
  kill -0 "$HOLDER_PID" 2>/dev/null || { echo "mooncake_client died" >&2; cat "$RUN/holder.log" >&2; exit 1; }
  http_get "http://127.0.0.1:$METRICS_PORT/metrics" | grep -q '^master_total_capacity_bytes [1-9]' && break
  [ "$i" = 200 ] && { echo "holder segment not mounted" >&2; cat "$RUN/holder.log" >&2; exit 1; }
  sleep 0.05
done
echo "mooncake up: master $MASTER_PID on 127.0.0.1:$RPC_PORT, holder $HOLDER_PID" >&2
export MOONCAKE_MASTER="127.0.0.1:$RPC_PORT" MOONCAKE_METADATA=P2PHANDSHAKE \
  MOONCAKE_METRICS="127.0.0.1:$METRICS_PORT"
"$@" & APP_PID=$!; PIDS="$APP_PID $PIDS"
set +e
wait "$APP_PID"; rc=$?
set -e
PIDS="$HOLDER_PID $MASTER_PID"
exit "$rc"
