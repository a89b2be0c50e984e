#!/usr/bin/env bash
# Configures and builds kvcd into ${KVCD_BUILD_DIR:-build} (ccache, Ninja, warnings as
# errors). Arguments are build targets (default: everything). The configuration comes from
# the environment, each setting passed on every run (so a build dir never keeps a stale one):
#   KVCD_BUILD_TYPE   RelWithDebInfo (default) | Debug | Release
#   KVCD_CUDA         AUTO (default: the CUDA kernels compiled when nvcc is found) | ON | OFF
#   KVCD_BUILD_TESTS  ON (default) | OFF    KVCD_BUILD_BENCH  ON (default) | OFF
#   KVCD_UNITY        OFF (default) | ON: CMake's unity build (a target's sources compiled a
#                     few per translation unit: each gRPC/protobuf/Abseil header parsed once
#                     per batch, not once per file). The test command and the main job turn
#                     it on for their cold builds; leave it off for incremental work (editing
#                     one file recompiles its whole batch). Batches of 16 sources (CMake's
#                     default 8 parsed the headers twice as often: 101 CPU-s against 92 for
#                     the targets of more than 8 sources).
#   KVCD_LEAN         OFF (default) | ON: with RelWithDebInfo, -O1 and no debug information
#                     (-DNDEBUG kept; the kernels keep their own -O3, kernels/). The test
#                     command's build: compiled once, its binaries run once, and debug
#                     information costs a third of a library's compile time at -O2
#                     (server/rpc's unity file: 17.3 CPU-s at -O2 -g, 12.1 at -O2, 9.8 at -O1);
#                     the CUDA device code at ptxas -O1 (compile-checked, never run).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
export CCACHE_DIR=${CCACHE_DIR:-$PWD/.cache/ccache}
# Paths relative to the clone in the cache's keys: a second clone reuses the first one's
# objects (an explicit CCACHE_BASEDIR wins).
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
relwithdebinfo="-O2 -g -DNDEBUG"
cuda_relwithdebinfo=$relwithdebinfo
if [[ ${KVCD_LEAN:-OFF} == ON ]]; then
  relwithdebinfo="-O1 -DNDEBUG"
  # The test command's CUDA objects are compile-checked, never run (no GPU in CI): ptxas at
  # -O1 still assembles and checks every kernel (inline PTX included) for a fifth less time
  # (fsq_decode_attention.cu: 22.3 CPU-s at ptxas -O3, 17.5 at -O0).
  cuda_relwithdebinfo="-O1 -DNDEBUG -Xptxas=-O1"
fi
cmake -S . -B "$build" -G Ninja --no-warn-unused-cli -DCMAKE_BUILD_TYPE=${KVCD_BUILD_TYPE:-RelWithDebInfo} \
  -DKVCD_CUDA=${KVCD_CUDA:-AUTO} -DKVCD_BUILD_TESTS=${KVCD_BUILD_TESTS:-ON} \
  -DKVCD_BUILD_BENCH=${KVCD_BUILD_BENCH:-ON} -DCMAKE_UNITY_BUILD=${KVCD_UNITY:-OFF} \
  -DCMAKE_UNITY_BUILD_BATCH_SIZE=16 \
  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=$relwithdebinfo" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=$relwithdebinfo" \
  "-DCMAKE_CUDA_FLAGS_RELWITHDEBINFO=$cuda_relwithdebinfo" >/dev/null
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build" -j "$(nproc)" "${targets[@]}"
