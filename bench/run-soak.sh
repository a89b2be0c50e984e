#!/usr/bin/env bash
# Soak test: a fresh daemon (CPU backend, the tiny model) under kvcd_soak — 1,000
# concurrent decode streams with mixed calls for 60 s on loopback — then the checks of
# bench/kvcd_soak.cc (0 errors, RSS growth bounded, pool back to idle, no leaked
# sequences). Writes bench/results/<date>-soak.md; exits 1 if a check fails.
#   bench/run-soak.sh [--streams N] [--seconds S] [kvcd_soak flags...]
# Not part of scripts/test.sh (too long); the integration tests run a 5 s, 50-stream one.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
source scripts/daemon-lib.sh
out=${KVCD_SOAK_RESULTS:-bench/results/$(date +%F)-soak.md}
config=$(mktemp --suffix=.yaml)
cat >"$config" <<'YAML'
listen: 127.0.0.1:0
metrics_listen: ""
backend: cpu
memory_budget: 80MiB
max_sequences: 4096
lease: {default_ms: 30000, max_ms: 600000}
drain_timeout_ms: 5000
models:
  - builtin: tiny        # 2 layers, 4 q / 2 kv heads, head_dim 16, page 4 (1 KiB pages)
    memory: 64MiB
YAML
start_kvcd "$build/server/kvcd" "$config"
trap 'kill $KVCD_PID 2>/dev/null || true; rm -f "$config"' EXIT
{
  echo "# Soak: $*"
  echo
  echo "- date: $(date -u +%FT%TZ), kvcd $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "- machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB; CPU backend, client and daemon on the same host (loopback)"
  echo "- daemon: the tiny model (2 layers, 4 q / 2 kv heads, head_dim 16, page 4), 64 MiB pool"
  echo "- command: \`bench/run-soak.sh $*\`"
} >>"$out"
status=0
"$build/bench/kvcd_soak" --target "$KVCD_GRPC" --daemon-pid "$KVCD_PID" --results "$out" "$@" ||
  status=$?
stop_kvcd || { echo "kvcd did not drain cleanly" | tee -a "$out"; status=1; }
trap - EXIT
rm -f "$config"
echo "wrote $out"
exit $status
