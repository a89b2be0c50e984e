#!/usr/bin/env bash
# Configures and builds kvcd into ${KVCD_BUILD_DIR:-build} (ccache, Ninja, warnings as
# errors). Arguments are build targets (default: everything).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
export CCACHE_DIR=${CCACHE_DIR:-$PWD/.cache/ccache}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${KVCD_BUILD_TYPE:-RelWithDebInfo} \
  -DKVCD_BUILD_TESTS=ON -DKVCD_BUILD_BENCH=ON >/dev/null
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build" -j "$(nproc)" "${targets[@]}"
