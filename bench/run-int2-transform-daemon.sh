#!/usr/bin/env bash
# Next-token KL through the daemon (CPU backend) of SmolLM2-135M-Instruct with transform-
# coded key history (int2-transform: codec file version 3 calibrated in process on
# bench/text/smollm2-calibration.txt, key rows past the sink) beside Hadamard INT2 and BF16,
# teacher-forced against FP32 on bench/text/smollm2-heldout.txt at production windows (page
# 16, sink 64, recent 256) — bench/results/2026-12-05-int2-transform-daemon.md:
#   1. the held-out text as the prompt, 16 steps after it (the setup of
#      2026-12-03-int2-quality.md's daemon KL table);
#   2. its last 64 tokens teacher-forced (--eval-text, --eval-steps 64).
# Needs: scripts/build.sh kvcd kvcd-llama and scripts/fetch-smollm2.sh. Output in
# ${OUT:-build/int2-transform-daemon}.
set -euo pipefail
cd "$(dirname "$0")/.."
b=${KVCD_BUILD_DIR:-build}
out=${OUT:-$b/int2-transform-daemon}
smol=${KVCD_MODEL_CACHE:-.cache/models}/smollm2-135m-instruct
histories=${HISTORIES:-bf16,int2-hadamard,int2-transform}
source scripts/daemon-lib.sh
mkdir -p "$out"
config=$(mktemp --suffix=.yaml)
cat >"$config" <<'YAML'
listen: 127.0.0.1:0
metrics_listen: ""
backend: cpu
memory_budget: 1GiB
drain_timeout_ms: 1000
YAML
start_kvcd "$b/server/kvcd" "$config"
trap 'kill $KVCD_PID 2>/dev/null || true; rm -f "$config"' EXIT
common=(--model "$smol" --target "$KVCD_GRPC" --calib-text bench/text/smollm2-calibration.txt
  --page 16 --sink 64 --recent 256 --memory-mib 128 --histories "$histories")
"$b/examples/kvcd-llama" "${common[@]}" --prompt "$(cat bench/text/smollm2-heldout.txt)" \
  --max-new 16 | tee "$out/prompt16.log"
"$b/examples/kvcd-llama" "${common[@]}" --eval-text bench/text/smollm2-heldout.txt \
  --eval-steps 64 | tee "$out/eval64.log"
stop_kvcd
