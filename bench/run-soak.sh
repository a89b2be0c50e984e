#!/usr/bin/env bash
# Soak test: a fresh daemon (CPU backend, the tiny model) under kvcd_soak — 1,000
# concurrent decode streams with mixed calls for 60 s on loopback — then the checks of
# bench/kvcd_soak.cc (0 errors, RSS growth bounded, pool back to idle, no leaked
# sequences). Writes bench/results/<date>-soak.md; exits 1 if a check fails.
#   bench/run-soak.sh [--model tiny|gqa] [--streams N] [--seconds S] [kvcd_soak flags...]
# --model gqa (first argument) serves a model where each call costs the daemon real work, so
# that the daemon, not the client, is the limit: 8 layers, 8 q / 2 kv heads, head_dim 128,
# page 16, history INT2 (Hadamard rotation: every session's middle page is quantized, every
# decode reads INT2 and BF16 pages), a 512 MiB pool. The default, tiny, is the one the
# integration test uses.
# Not part of scripts/test.sh (too long); the integration tests run a 5 s, 50-stream one.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
source scripts/daemon-lib.sh
out=${KVCD_SOAK_RESULTS:-bench/results/$(date +%F)-soak.md}
shape=tiny
if [[ ${1:-} == --model ]]; then
  shape=${2:?--model needs tiny or gqa}
  shift 2
fi
config=$(mktemp --suffix=.yaml)
case $shape in
  tiny)
    budget=80MiB
    model_yaml='  - builtin: tiny        # 2 layers, 4 q / 2 kv heads, head_dim 16, page 4 (1 KiB pages)
    memory: 64MiB'
    model_line="the tiny model (2 layers, 4 q / 2 kv heads, head_dim 16, page 4), 64 MiB pool" ;;
  gqa)
    budget=600MiB
    model_yaml='  - name: gqa             # 128 KiB BF16 pages of 16 tokens; INT2 history after them
    num_layers: 8
    num_q_heads: 8
    num_kv_heads: 2
    head_dim: 128
    page_size: 16
    sink_tokens: 16
    recent_tokens: 16
    history_format: int2-oscar
    codec: hadamard
    bf16_fraction: 0.75
    memory: 512MiB'
    model_line="gqa (8 layers, 8 q / 2 kv heads, head_dim 128, page 16, sink 16 + recent 16 BF16, INT2-oscar history with the Hadamard rotation), 512 MiB pool (75% BF16)" ;;
  *) echo "run-soak.sh: --model is '$shape', expected tiny or gqa" >&2; exit 2 ;;
esac
cat >"$config" <<YAML
listen: 127.0.0.1:0
metrics_listen: ""
backend: cpu
memory_budget: $budget
max_sequences: 4096
lease: {default_ms: 30000, max_ms: 600000}
drain_timeout_ms: 5000
models:
$model_yaml
YAML
start_kvcd "$build/server/kvcd" "$config"
trap 'kill $KVCD_PID 2>/dev/null || true; rm -f "$config"' EXIT
{
  echo "# Soak: $*"
  echo
  echo "- date: $(date -u +%FT%TZ), kvcd $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "- machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB; CPU backend, client and daemon on the same host (loopback)"
  echo "- daemon: $model_line"
  echo "- command: \`bench/run-soak.sh --model $shape $*\`"
} >>"$out"
status=0
"$build/bench/kvcd_soak" --target "$KVCD_GRPC" --model "$shape" --daemon-pid "$KVCD_PID" \
  --results "$out" "$@" ||
  status=$?
stop_kvcd || { echo "kvcd did not drain cleanly" | tee -a "$out"; status=1; }
trap - EXIT
rm -f "$config"
echo "wrote $out"
exit $status
