#!/usr/bin/env bash
# Issue #37's sanitizer row for the FSQ decode kernels (every variant, int8-2cta-fixed
# included): compute-sanitizer racecheck (shared-memory hazards) on the CUDA FSQ tests' small
# cases (KVCD_FSQ_TEST_SMALL=1), ~1 minute. memcheck runs in run-h200-fsq-merge.sh.
#   device: tar -xJf .devrun/pack.tar.xz && bench/run-h200-fsq-race.sh   (carry [".devrun"])
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=$PWD/.devlibs
BIN=${KVCD_BIN:-.devbin}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
KVCD_FSQ_TEST_SMALL=1 timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 \
  "$BIN/kvcd_cuda_tests" --gtest_filter='CudaFsqTest.Decode*' 2>&1 |
  grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|^\[  (PASSED|FAILED)|hazard' | head -20
exit "${PIPESTATUS[0]}"
