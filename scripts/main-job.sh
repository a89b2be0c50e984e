#!/usr/bin/env bash
# The main job: install dependencies, build, start a real kvcd daemon on the CPU
# backend, drive a synthetic prefill -> prefix-shared decode workload through the real
# client (kvcd_demo), print its summary, and stop the daemon with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh kvcd kvctl kvcd_demo
build=${KVCD_BUILD_DIR:-build}
source scripts/daemon-lib.sh
start_kvcd "$build/server/kvcd" deploy/config/kvcd-demo.yaml
trap 'kill $KVCD_PID 2>/dev/null || true' EXIT
grep '^kvcd ready' "$KVCD_LOG_DIR/out"
target=$KVCD_GRPC
metrics=$KVCD_METRICS
status=0
"$build/examples/kvcd_demo" --target "$target" "$@" || status=$?
echo
echo "--- kvctl stats ---"
"$build/client/kvctl" --target "$target" stats || status=$?
echo "--- a few of the daemon's metrics (http://$metrics/metrics) ---"
curl -s "http://$metrics/metrics" | grep -E '^kvcd_(pool_pages|radix_|evicted|active_seq|attention_calls)' || true
stop_kvcd || status=$?
trap - EXIT
echo "--- daemon log ---"
cat "$KVCD_LOG_DIR/err"
exit $status
