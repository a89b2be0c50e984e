#!/usr/bin/env bash
# The tests: install dependencies, check formatting, build everything with warnings as
# errors (CUDA sources compile-checked for sm_90 when nvcc exists), run every unit and
# integration test with CTest, the unit tests again under ASan+UBSan, and the Python
# client's tests against the real daemon, the Python FSQ tools' tests, and the deployment checks (image, manifests,
# chart, rules, dashboard against a real Prometheus).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/check-format.sh
./scripts/build.sh
./scripts/fetch-smollm2.sh >/dev/null  # SmolLM2-135M for tests/integration/smollm2_test.cc (cached)
ctest --test-dir "${KVCD_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" --timeout 600
./scripts/test-asan.sh
./scripts/test-python.sh
./scripts/test-fsq-tools.sh
./scripts/test-deploy.sh
