#!/usr/bin/env bash
# FSQ codecs trained on the H200 (bench/run-h200-fsq-train.sh) against every other history
# format, served by a real daemon (CPU backend, loopback) and evaluated by kvcd-llama
# teacher-forced on the held-out text bench/text/smollm2-heldout.txt (never trained on,
# never used to select) against the FP32 model: BF16, Hadamard INT2, int2-transform
# (calibrated in process on bench/text/smollm2-calibration.txt), FSQ G = 128 / 48 / 16
# initialized in process on the same text, the initialized codec files the training started
# from (INIT, default .cache/fsq-stage/final) and the trained ones (CODECS: a folder with
# fsq-g128.st, fsq-g48.st, fsq-g16.st), in one kvcd-llama run per window setting: the CI
# windows (sink 16, recent 32) and the production windows (sink 64, recent 256), page 16,
# the text's last STEPS (64) tokens fed one by one. Writes OUT/{ci,prod}.{log,json} and
# OUT/kl-vs-compression.png (tools/plot_quality.py, from the JSON).
# Needs: scripts/build.sh kvcd kvcd-llama; scripts/fetch-smollm2.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
b=${KVCD_BUILD_DIR:-build}
out=${OUT:-$b/fsq-trained-smollm2}
codecs=${CODECS:?set CODECS to the folder of the trained codec files}
init=${INIT:-.cache/fsq-stage/final}
smol=${KVCD_MODEL_CACHE:-.cache/models}/smollm2-135m-instruct
steps=${STEPS:-64}
py="$(./scripts/fsq-venv.sh)/bin/python"
source scripts/daemon-lib.sh
mkdir -p "$out"
config=$(mktemp --suffix=.yaml)
cat >"$config" <<'YAML'
listen: 127.0.0.1:0
metrics_listen: ""
backend: cpu
memory_budget: 2GiB
drain_timeout_ms: 1000
YAML
trap 'kill ${KVCD_PID:-} 2>/dev/null || true; rm -f "$config"' EXIT
h="bf16,int2-hadamard,int2-transform,fsq:G=128,fsq:G=48,fsq:G=16"
for g in 128 48 16; do h+=",fsq=$init/fsq-g$g-init.st"; done
for g in 128 48 16; do h+=",fsq=$codecs/fsq-g$g.st"; done
for w in "ci 16 32" "prod 64 256"; do
  read -r name sink recent <<<"$w"
  # A daemon per window setting: kvcd-llama registers llama-0, llama-1, ... with its windows.
  start_kvcd "$b/server/kvcd" "$config"
  "$b/examples/kvcd-llama" --model "$smol" --target "$KVCD_GRPC" \
    --calib-text bench/text/smollm2-calibration.txt \
    --eval-text bench/text/smollm2-heldout.txt --eval-steps "$steps" \
    --page 16 --sink "$sink" --recent "$recent" --memory-mib 64 --histories "$h" \
    --json "$out/$name.json" | tee "$out/$name.log"
  stop_kvcd
done
"$py" tools/plot_quality.py "$out/kl-vs-compression.png" "$out/ci.json" "$out/prod.json" \
  --metric kl_mean --x compression_ratio_history \
  --labels "sink 16 / recent 32 (CI),sink 64 / recent 256 (production)" \
  --title "SmolLM2-135M-Instruct, held-out text: mean next-token KL vs history compression"
