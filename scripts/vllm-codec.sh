#!/usr/bin/env bash
# A version-3 codec file (int2-transform, docs/formats.md) for SmolLM2-135M-Instruct as vLLM
# serves it (the HF-layout BF16 model of scripts/vllm-model.sh): activation dumps of
# bench/text/smollm2-calibration.txt and smollm2-heldout.txt (512 tokens each, FP32, by
# tools/dump_activations.py in the vLLM venv), the calibration dump's tokens then placed, in
# 4 more copies, at positions drawn from [0, KVCD_CODEC_POSITIONS) (default 8192, SmolLM2's
# context) by tools/reposition_dump.py (post-RoPE q and k turned by RoPE), fitted by
# kvcd-int2-study --out-codec. int2-transform stores post-RoPE keys: a codec fitted at
# positions < 512 only mispredicts the slow RoPE pairs further on (10.9 nats of next-token
# KL at 4k in bench/results/2026-12-05-vllm-connector.md). Cached under
# ~/.cache/kvcd/smollm2-codec-v3-<stamp> (${KVCD_MODEL_CACHE:-.cache/models} while tools/,
# kernels/ or common/ hold uncommitted changes), redone when the texts, the model, the
# tools, kvcd-int2-study's sources or the positions change. Needs scripts/build.sh kvcd-int2-study.
# Argument: the venv (default: scripts/vllm-venv.sh's). Prints the codec file's path on its
# last line.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
cache=${KVCD_MODEL_CACHE:-$PWD/.cache/models}
venv=${1:-$(./scripts/vllm-venv.sh | tail -1)}
model=$(./scripts/vllm-model.sh "$venv" | tail -1)
study=$build/tools/kvcd-int2-study
positions=${KVCD_CODEC_POSITIONS:-8192}
# What the fit depends on: the texts, the model, the Python tools, the positions and
# kvcd-int2-study. The study is named by its sources (git's tree ids of tools/, kernels/ and
# common/) when they are committed, so clean clones of one commit share the codec in the
# cache outside the clone; by the binary itself otherwise (uncommitted changes).
if git diff --quiet HEAD -- tools kernels common 2>/dev/null &&
  study_id=$(git rev-parse HEAD:tools HEAD:kernels HEAD:common 2>/dev/null); then
  codec_root=${KVCD_CODEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcd}
else
  study_id=$(sha256sum <"$study")
  codec_root=$cache
fi
stamp=$( (cat bench/text/smollm2-calibration.txt bench/text/smollm2-heldout.txt "$model/STAMP" \
  tools/dump_activations.py tools/reposition_dump.py; echo "$study_id"; echo "$positions") |
  sha256sum | cut -c1-16)
out=$codec_root/smollm2-codec-v3-$stamp
if [[ -f $out/codec.safetensors && "$(cat "$out/STAMP" 2>/dev/null)" == "$stamp" ]]; then
  echo "$out/codec.safetensors"
  exit 0
fi
mkdir -p "$out"
for t in calibration heldout; do
  TQDM_DISABLE=1 "$venv/bin/python" tools/dump_activations.py --model "$model" --dtype float32 \
    --prompts "bench/text/smollm2-$t.txt" --max-tokens 512 --out "$out/$t.dump.safetensors" >&2
done
"$venv/bin/python" tools/reposition_dump.py --in "$out/calibration.dump.safetensors" \
  --out "$out/calibration-moved.dump.safetensors" --rope-theta 100000 --pairing half \
  --max-position "$positions" --copies 4 >&2
"$study" --calib "$out/calibration-moved.dump.safetensors" --heldout "$out/heldout.dump.safetensors" \
  --variants best --out-codec "$out/codec.safetensors" >"$out/study.log"
rm -f "$out"/*.dump.safetensors
echo "$stamp" >"$out/STAMP"
echo "$out/codec.safetensors"
