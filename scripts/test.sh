#!/usr/bin/env bash
# The tests: install dependencies, build everything (CUDA sources compile-checked for
# sm_90 when nvcc exists), and run every unit and integration test with CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
ctest --test-dir "${KVCD_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" --timeout 600
