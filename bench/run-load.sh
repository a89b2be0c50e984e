#!/usr/bin/env bash
# Runs the loopback load tool against a fresh daemon and writes
# bench/results/<date>-loopback-load.md with the machine it ran on.
#   bench/run-load.sh [kvcd_load flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
source scripts/daemon-lib.sh
out=bench/results/$(date +%F)-loopback-load.md
start_kvcd "$build/server/kvcd" deploy/config/kvcd-demo.yaml
trap 'kill $KVCD_PID 2>/dev/null || true' EXIT
{
  echo "# Loopback load: Put / Match / AttentionDecode through gRPC"
  echo
  echo "- date: $(date -u +%FT%TZ), kvcd $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "- machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB; client and daemon on the same host (loopback)"
  echo "- daemon: deploy/config/kvcd-demo.yaml (CPU backend, qwen3-8b geometry: 36 layers, 32 q / 8 kv heads, head_dim 128, BF16 pages of 64 tokens)"
  echo "- command: \`bench/run-load.sh $*\`"
  echo "- put: one 64-token prompt per call (9.4 MB of BF16 K/V); match: a cached 4096-token prompt; attend: unary batch-1 AttentionDecode over a 4096-token sequence, layers in turn"
} >"$out"
"$build/bench/kvcd_load" --target "$KVCD_GRPC" --results "$out" "$@"
stop_kvcd
trap - EXIT
echo "wrote $out"
