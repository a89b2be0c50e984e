#!/usr/bin/env bash
# A version-3 codec file (int2-transform, docs/formats.md) for SmolLM2-135M-Instruct:
# activation dumps of bench/text/smollm2-calibration.txt and smollm2-heldout.txt by
# kvcd-llama's FP32 reference (512 tokens each), the calibration dump's tokens then placed,
# in 4 more copies, at positions drawn from [0, KVCD_CODEC_POSITIONS) (default 8192,
# SmolLM2's context) by tools/reposition_dump.py (their post-RoPE q and k turned by RoPE),
# fitted by kvcd-int2-study --out-codec. int2-transform stores post-RoPE keys: a codec fitted
# at positions < 512 only mispredicts the slow RoPE pairs' keys further on (10.9 nats of
# next-token KL at 4k in bench/results/2026-12-05-vllm-connector.md). Cached under
# ${KVCD_MODEL_CACHE:-.cache/models}/smollm2-codec-v3 (redone when the texts, the model, the
# two binaries, the tool or the positions change). Needs scripts/build.sh kvcd-llama
# kvcd-int2-study, and NumPy in $PYTHON (default: the vLLM venv's python). Prints the codec
# file's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
cache=${KVCD_MODEL_CACHE:-$PWD/.cache/models}
smol=$(./scripts/fetch-smollm2.sh | tail -1)
out=$cache/smollm2-codec-v3
llama=$build/examples/kvcd-llama
study=$build/tools/kvcd-int2-study
positions=${KVCD_CODEC_POSITIONS:-8192}
stamp=$( (cat bench/text/smollm2-calibration.txt bench/text/smollm2-heldout.txt "$smol/STAMP" \
  "$llama" "$study" tools/reposition_dump.py; echo "$positions") | sha256sum | cut -c1-16)
if [[ -f $out/codec.safetensors && "$(cat "$out/STAMP" 2>/dev/null)" == "$stamp" ]]; then
  echo "$out/codec.safetensors"
  exit 0
fi
py=${PYTHON:-$(./scripts/vllm-venv.sh | tail -1)/bin/python}
mkdir -p "$out"
for t in calibration heldout; do
  "$llama" --model "$smol" --dump "$out/$t.dump.safetensors" \
    --dump_text "bench/text/smollm2-$t.txt" --dump_max_tokens 512 >&2
done
"$py" tools/reposition_dump.py --in "$out/calibration.dump.safetensors" \
  --out "$out/calibration-moved.dump.safetensors" --rope-theta 100000 --pairing half \
  --max-position "$positions" --copies 4 >&2
"$study" --calib "$out/calibration-moved.dump.safetensors" --heldout "$out/heldout.dump.safetensors" \
  --variants best --out-codec "$out/codec.safetensors" >"$out/study.log"
rm -f "$out"/*.dump.safetensors
echo "$stamp" >"$out/STAMP"
echo "$out/codec.safetensors"
