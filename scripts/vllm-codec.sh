#!/usr/bin/env bash
# A version-3 codec file (int2-transform, docs/formats.md) for SmolLM2-135M-Instruct:
# activation dumps of bench/text/smollm2-calibration.txt and smollm2-heldout.txt by
# kvcd-llama's FP32 reference, fitted by kvcd-int2-study --out-codec. Cached under
# ${KVCD_MODEL_CACHE:-.cache/models}/smollm2-codec-v3 (redone when the texts, the model or the
# two binaries change). Needs scripts/build.sh kvcd-llama kvcd-int2-study. Prints the codec
# file's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
cache=${KVCD_MODEL_CACHE:-$PWD/.cache/models}
smol=$(./scripts/fetch-smollm2.sh | tail -1)
out=$cache/smollm2-codec-v3
llama=$build/examples/kvcd-llama
study=$build/tools/kvcd-int2-study
stamp=$(cat bench/text/smollm2-calibration.txt bench/text/smollm2-heldout.txt "$smol/STAMP" \
  "$llama" "$study" | sha256sum | cut -c1-16)
if [[ -f $out/codec.safetensors && "$(cat "$out/STAMP" 2>/dev/null)" == "$stamp" ]]; then
  echo "$out/codec.safetensors"
  exit 0
fi
mkdir -p "$out"
for t in calibration heldout; do
  "$llama" --model "$smol" --dump "$out/$t.dump.safetensors" \
    --dump_text "bench/text/smollm2-$t.txt" --dump_max_tokens 512 >&2
done
"$study" --calib "$out/calibration.dump.safetensors" --heldout "$out/heldout.dump.safetensors" \
  --variants best --out-codec "$out/codec.safetensors" >"$out/study.log"
rm -f "$out"/*.dump.safetensors
echo "$stamp" >"$out/STAMP"
echo "$out/codec.safetensors"
