#!/usr/bin/env bash
# FSQ history on real weights, served by the daemon (CPU backend), teacher-forced against
# FP32 (bench/results/2026-12-04-fsq-real-models.md):
#   stories260K: codecs initialized in process on the model's greedy text from "Once upon a
#     time" (512 positions), evaluated on its greedy text from "Tom had a big dog" (512
#     positions), G = 64 / 32 / 16 (4x / 8x / 16x of the dense K/V bytes), beside INT2
#     (naive, Hadamard, OSCAR calibrated on the same text); page 4, sink 4, recent 8.
#   SmolLM2-135M-Instruct (if scripts/fetch-smollm2.sh has run): calibrated on
#     bench/text/smollm2-calibration.txt, evaluated on the last 64 tokens of
#     bench/text/smollm2-heldout.txt, G = 128 / 48 / 16 (12x / 32x / 96x), beside INT2;
#     page 16, sink 16, recent 32.
# Extra histories (e.g. a fine-tuned codec: fsq=PATH) via STORIES_EXTRA / SMOLLM2_EXTRA
# (comma-separated, appended). Needs: scripts/build.sh kvcd kvcd_stories kvcd-llama.
# Output in ${OUT:-build/fsq-real-models}.
set -euo pipefail
cd "$(dirname "$0")/.."
b=${KVCD_BUILD_DIR:-build}
out=${OUT:-$b/fsq-real-models}
data=${KVCD_SHARED_DATA:-../shared/data}/stories260K
smol=${KVCD_MODEL_CACHE:-.cache/models}/smollm2-135m-instruct
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

stories="int2-identity,int2-hadamard,int2-oscar,fsq:G=64,fsq:G=32,fsq:G=16${STORIES_EXTRA:+,$STORIES_EXTRA}"
"$b/examples/kvcd_stories" --target "$KVCD_GRPC" \
  --checkpoint "$data/stories260K.bin" --tokenizer "$data/tok512.bin" \
  --prompt "Tom had a big dog" --steps 512 \
  --calib-prompts "Once upon a time" --calib-steps 512 \
  --formats "$stories" | tee "$out/stories260k.log"

if [[ -f $smol/model.safetensors ]]; then
  smollm2="int2-hadamard,int2-oscar,fsq:G=128,fsq:G=48,fsq:G=16${SMOLLM2_EXTRA:+,$SMOLLM2_EXTRA}"
  "$b/examples/kvcd-llama" --model "$smol" --target "$KVCD_GRPC" \
    --calib-text bench/text/smollm2-calibration.txt \
    --eval-text bench/text/smollm2-heldout.txt --eval-steps 64 \
    --memory-mib 128 --histories "$smollm2" | tee "$out/smollm2.log"
else
  echo "no SmolLM2 at $smol (scripts/fetch-smollm2.sh): skipped" | tee "$out/smollm2.log"
fi
stop_kvcd
