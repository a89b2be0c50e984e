#!/usr/bin/env bash
# The inner loop: an incremental build (ccache, Ninja) of what CTest runs, then every unit
# and integration test (CTest, both cores). No dependency install, no sanitizer build, no
# fuzzing, no image, no Python environments; a few minutes when the build is warm.
#   scripts/test-fast.sh             # build + CTest
#   scripts/test-fast.sh -R Daemon   # arguments go to ctest (a subset)
#   KVCD_FAST_PYTHON=1 scripts/test-fast.sh   # also the Python client's tests (its venv is
#                                             # cached under .cache/python-venv)
# The whole test command (sanitizers, fuzzing, Python tools, deployment) is scripts/test.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/test-lib.sh
export CCACHE_DIR=${CCACHE_DIR:-$PWD/.cache/ccache}
build=${KVCD_BUILD_DIR:-build}
phase build ./scripts/build.sh || { phase_summary; exit 1; }
phase ctest ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 600 "$@"
[[ -z ${KVCD_FAST_PYTHON:-} ]] || phase python ./scripts/test-python.sh
phase_summary
