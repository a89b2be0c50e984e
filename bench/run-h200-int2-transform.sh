#!/usr/bin/env bash
# The device run of int2-transform history on the CUDA backend (#22; < 3 minutes):
#   1. the CUDA int2-transform kernel tests against the CPU definitions (kvcd_cuda_tests
#      *Transform*): the row store byte for byte against EncodeTransformKeys +
#      DemoteRowsToInt2, decode attention against AttendTransformPagesReference; then their
#      small cases under compute-sanitizer memcheck and racecheck;
#   2. the daemon test: the real daemon (backend cuda) and a second one (backend cpu) with the
#      same int2-transform model (SmolLM2-135M's 9 q / 3 kv heads, d 64; codec file version
#      3): Put inline and over CUDA IPC, the fused per-layer decode loop past two demotions
#      (inline, and everything on the device), PushPages over IPC with the device checks,
#      unsupported geometries; stored bytes must equal the CPU backend's, attention close
#      (the test prints the largest error it saw);
#   3. the existing INT2 / BF16 data-plane tests (their demotion shares the new helper);
#   4. kernel timing beside the INT2 kernel (cuda_transform_bench): SmolLM2-135M and Qwen3-8B
#      layers, batch 1, 32k and 100k tokens, us and GB/s; the Put-size row stores.
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh   (pack-device.sh packs every binary
#           it lists: build them all)
#   device: bench/run-h200-int2-transform.sh   (device tool, carry [".devbin", ".devlibs"])
# Writes $OUT/transform-kernels.log, transform-memcheck.log, transform-racecheck.log,
# transform-data-plane.log, data-plane.log, transform-bench.log, transform-bench.md and
# summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvcd-h200-int2-transform}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs
BIN=${KVCD_BIN:-.devbin}
summary() { echo "$*" | tee -a "$out/summary.txt"; }
: > "$out/summary.txt"
summary "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
result() {  # name log rc
  summary "$1 rc $3: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?' "$2" | tr '\n' ' ')"
}
timeout 25 "$BIN/kvcd_cuda_tests" --gtest_filter='*Transform*' > "$out/transform-kernels.log" 2>&1
result "int2-transform kernels" "$out/transform-kernels.log" $?
for tool in memcheck racecheck; do  # small cases (KVCD_TRANSFORM_TEST_SMALL)
  KVCD_TRANSFORM_TEST_SMALL=1 timeout 30 compute-sanitizer --tool $tool --error-exitcode 9 \
    "$BIN/kvcd_cuda_tests" --gtest_filter='CudaTransformTest.*' > "$out/transform-$tool.log" 2>&1
  result "int2-transform kernels under compute-sanitizer $tool" "$out/transform-$tool.log" $?
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/transform-$tool.log" | tail -1 |
    tee -a "$out/summary.txt"
done
KVCD_BINARY=$BIN/kvcd timeout 45 "$BIN/kvcd_data_plane_tests" \
  --gtest_filter='Formats/*.*/int2_transform' > "$out/transform-data-plane.log" 2>&1
result "int2-transform data plane (cuda daemon vs cpu daemon)" "$out/transform-data-plane.log" $?
grep -E '^int2-transform: CUDA vs CPU' "$out/transform-data-plane.log" | tee -a "$out/summary.txt"
# The INT2 / BF16 data-plane tests (the INT2 demotion's arguments moved into cuda_rows).
KVCD_BINARY=$BIN/kvcd timeout 30 "$BIN/kvcd_data_plane_tests" \
  --gtest_filter='Models/DataPlaneTest.*:-*Nccl*:*LeaseExpiry*' > "$out/data-plane.log" 2>&1
result "data plane (int2, bf16)" "$out/data-plane.log" $?
grep -hE '^\[  FAILED|Failure|rror' "$out/transform-kernels.log" \
  "$out/transform-data-plane.log" "$out/data-plane.log" | head -30
timeout 20 "$BIN/cuda_transform_bench" --out "$out/transform-bench.md" \
  > "$out/transform-bench.log" 2>&1
summary "cuda_transform_bench rc $?"
cat "$out/transform-bench.log" | tee -a "$out/summary.txt"
