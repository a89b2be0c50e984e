#!/usr/bin/env bash
# The unit tests under AddressSanitizer + UndefinedBehaviorSanitizer: a CPU-only build
# (-DKVCD_SANITIZER=asan, no CUDA, no benchmarks) in ${KVCD_ASAN_BUILD_DIR:-build-asan}.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_ASAN_BUILD_DIR:-build-asan}
export CCACHE_DIR=${CCACHE_DIR:-$PWD/.cache/ccache}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DKVCD_SANITIZER=asan -DKVCD_CUDA=OFF \
  -DKVCD_BUILD_TESTS=ON -DKVCD_BUILD_BENCH=OFF -DCMAKE_CXX_FLAGS=-O1 >/dev/null
cmake --build "$build" -j "$(nproc)" --target kvcd_unit_tests --target kvcd_tools_tests
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
"$build/tests/kvcd_unit_tests" --gtest_brief=1
"$build/tests/kvcd_tools_tests" --gtest_brief=1
