#!/usr/bin/env bash
# A version-3 codec file (int2-transform history, docs/formats.md) for the builtin qwen3-8b
# geometry (36 layers, 32 q / 8 KV heads, head_dim 128), for TIMING ONLY: it is fitted on
# kvcd's SYNTHETIC activations (kvcd-calibrate synth, testing/synthetic_activations.h), not
# on real Qwen3-8B activations, so it says nothing about quality. The file name and its
# kvcd.source metadata (the dump's path) say "synthetic". Two existing tools, no GPU:
#   1. kvcd-calibrate synth: a 320-token activation dump of that geometry (seed 1; 320 is
#      the fewest kvcd-int2-study takes: 2 * head_dim rows past its 64-token sink);
#   2. kvcd-int2-study --variants best --code-bits 272 --out-codec: the tc-whiten key
#      transform and the Hadamard value rotation fitted on it, written as codec file version
#      3 (the study's score on the same dump is printed to the log and means nothing). 272
#      code bits + the 16-bit gain = 36 bytes per key row and head, INT2's (32 bytes of
#      codes, FP16 scale and min) at head_dim 128: pages of the same 1,327,104 bytes, so the
#      timing compares the codes' compute, not a smaller read.
# Measured on the 2-core build machine (shared, load ~3): ~41 s wall, ~36 s of one core
# (~4 s the dump, ~17 s the fit, the rest the study's scoring), ~1 GB of memory, a 283 MB
# dump (deleted) and a 57 MB codec file, the same bytes on every run. 57 MB does not fit beside the binaries in
# the device tool's 64 MiB carry, so the device makes it with the carried tools (stripped:
# 0.5 + 0.6 MB; scripts/pack-device.sh packs tools/kvcd-calibrate and kvcd-int2-study).
# Usage: bench/make-qwen3-transform-codec.sh [OUT]
#   OUT: the codec file (default ${KVCD_BUILD_DIR:-build}/qwen3-8b-synthetic-transform-codec
#   .safetensors); KVCD_TOOLS: the folder holding both tools (default ${KVCD_BUILD_DIR:-build}
#   /tools; on the device .devbin). Prints the codec file's path on its last line.
#
# Checked here on the CPU backend (the commands, from the repository root, after
# ./scripts/build.sh kvcd kvctl kvcd-calibrate kvcd-int2-study kvcd_decode_worker):
#   bench/make-qwen3-transform-codec.sh /tmp/q3x/codec.safetensors
#   cat > /tmp/q3x/kvcd.yaml <<'YAML'
#   listen: 127.0.0.1:50077
#   metrics_listen: ""
#   backend: cpu
#   memory_budget: 2GiB
#   models:
#     - builtin: qwen3-8b
#       name: qwen3-8b-xform
#       history_format: int2-oscar
#       codec_file: /tmp/q3x/codec.safetensors
#       memory: 1GiB
#   YAML
#   build/server/kvcd serve --config /tmp/q3x/kvcd.yaml &   # until it prints "kvcd ready"
#   build/client/kvctl --target 127.0.0.1:50077 models    # codec: int2-transform (...)
#   build/client/workers/kvcd_decode_worker --target 127.0.0.1:50077 --model qwen3-8b-xform \
#     --tokens 384 --salt cpu --steps 2 --io host
#   kill %1
# kvctl lists "codec int2-transform (codec file version 3, 272 key code bits per row)" and
# the pools bf16 (28 pages) and int2-transform (606 pages of 1,327,104 bytes); the worker
# appends the 384-token prompt, decodes 2 tokens (~38 tokens/s on the shared 2 cores) and
# ends at "final length 386". history_format int2-oscar with a version-3 codec_file is the
# int2-transform history. kvcd_prefill_worker needs a CUDA device (here: "cudaSetDevice:
# CUDA driver version is insufficient"); on the GPU bench/run-decode-batch.sh stores the
# xform prompts with its --mode put, since its push fills INT2-layout pages, whose key gains
# an int2-transform pool rejects.
set -euo pipefail
cd "$(dirname "$0")/.."
b=${KVCD_BUILD_DIR:-build}
tools=$(realpath "${KVCD_TOOLS:-$b/tools}")
out=$(realpath -m "${1:-$b/qwen3-8b-synthetic-transform-codec.safetensors}")
mkdir -p "$(dirname "$out")"
work=$(mktemp -d "$(dirname "$out")/qwen3-synthetic.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"  # the dump's relative name becomes the codec's kvcd.source: the same file each run
dump=qwen3-8b-synthetic-activations-seed1.safetensors
"$tools/kvcd-calibrate" synth --out "$dump" --tokens 320 --layers 36 --q-heads 32 --kv-heads 8 \
  --head-dim 128 --seed 1 >&2
# The study scores its codes on a held-out dump after writing the file: the same synthetic
# dump here, one query position, windows that leave 8 tokens of history (its least work).
"$tools/kvcd-int2-study" --calib "$dump" --heldout "$dump" --variants best --positions 1 \
  --recent 248 --code-bits 272 --out-codec "$out" >study.log 2>&1 || {
  cat study.log >&2
  exit 1
}
grep -q '^wrote codec file version 3' study.log
echo "$out"
