#!/usr/bin/env bash
# The kernel run behind bench/results/*-h200-int2-decode*.md. Build here (CUDA 13, sm_90),
# then run on the H200 machine (the `device` tool with carry [".devbin", ".devlibs"]); the
# baseline needs the machine's PyTorch. Logs go to $OUT (or /tmp/kvcd-h200).
#   here:   bench/run-h200.sh build      -> .devbin, .devlibs (scripts/pack-device.sh)
#   device: bench/run-h200.sh run        (kernel tests + sanitizers, INT2 checks and timings,
#                                         torch SDPA cuDNN/flash baseline)
#           bench/run-h200.sh profile [batch]   (ncu on one v2 launch)
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  build)
    ./scripts/build.sh && ./scripts/pack-device.sh
    ;;
  run)  # kernel tests (+ compute-sanitizer), INT2 checks and timings, the SDPA baseline
    out=${OUT:-/tmp/kvcd-h200}
    mkdir -p "$out"
    export LD_LIBRARY_PATH=$PWD/.devlibs
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    .devbin/kvcd_cuda_tests > "$out/cuda-tests.log" 2>&1; echo "kvcd_cuda_tests rc $?"
    KVCD_BINARY=.devbin/kvcd .devbin/kvcd_data_plane_tests > "$out/data-plane-tests.log" 2>&1
    echo "kvcd_data_plane_tests rc $?"
    tail -3 "$out/cuda-tests.log"
    for tool in memcheck racecheck; do
      compute-sanitizer --tool $tool .devbin/kvcd_cuda_tests --gtest_filter='*Mixed*' \
        > "$out/sanitizer-$tool.log" 2>&1; echo "$tool rc $?: $(tail -1 "$out/sanitizer-$tool.log")"
    done
    .devbin/cuda_int2_bench > "$out/int2-bench.log" 2>&1; echo "cuda_int2_bench rc $?"
    grep -E "FAIL|ceiling|demote" "$out/int2-bench.log"
    sed -n '/^INT2 decode/,$p' "$out/int2-bench.log"
    [ "${KVCD_SKIP_SDPA:-0}" = 1 ] || python3 bench/sdpa_baseline.py 2>&1 | tee "$out/sdpa.log"
    ;;
  profile)  # Nsight Compute on one v2 launch: 100k tokens, batch $2 (default 8)
    export LD_LIBRARY_PATH=$PWD/.devlibs
    ncu --clock-control none -k "regex:${KVCD_NCU_KERNELS:-Int2DecodeKernelV2}" \
      -c "${KVCD_NCU_COUNT:-1}" --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section LaunchStats --section Occupancy .devbin/cuda_int2_bench --one 100000 "${2:-8}" 4
    ;;
  *) echo "usage: $0 build|run|profile [batch]" >&2; exit 2 ;;
esac
