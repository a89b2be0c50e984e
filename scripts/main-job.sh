#!/usr/bin/env bash
# The main job: install dependencies, build, start a real kvcd daemon on the CPU
# backend, drive a synthetic prefill -> prefix-shared decode workload through the real
# client (kvcd_demo), print its summary, and stop the daemon with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh -DKVCD_BUILD_TESTS=OFF -DKVCD_BUILD_BENCH=OFF
build=${KVCD_BUILD_DIR:-build}
log=$(mktemp -d)
"$build/server/kvcd" serve --config deploy/config/kvcd-demo.yaml >"$log/out" 2>"$log/err" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do  # the ready line comes once the pools are allocated
  grep -q '^kvcd ready' "$log/out" && break
  kill -0 $pid 2>/dev/null || { cat "$log/err"; echo "kvcd exited before it was ready"; exit 1; }
  sleep 0.1
done
grep '^kvcd ready' "$log/out" || { cat "$log/err"; echo "kvcd did not become ready"; exit 1; }
target=$(sed -n 's/.*grpc=\([^ ]*\).*/\1/p' "$log/out")
metrics=$(sed -n 's/.*metrics=\([^ ]*\).*/\1/p' "$log/out")
status=0
"$build/client/examples/kvcd_demo" --target "$target" "$@" || status=$?
echo
echo "--- kvctl stats ---"
"$build/client/kvctl" --target "$target" stats || status=$?
echo "--- a few of the daemon's metrics (http://$metrics/metrics) ---"
curl -s "http://$metrics/metrics" | grep -E '^kvcd_(pool_pages|radix_|evicted|active_seq|attention_calls)' || true
kill -TERM $pid
wait $pid || status=$?
trap - EXIT
echo "--- daemon log ---"
cat "$log/err"
exit $status
