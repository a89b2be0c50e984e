#!/usr/bin/env bash
# The unit tests under AddressSanitizer + UndefinedBehaviorSanitizer, in the one instrumented
# build that the fuzz targets share (scripts/test-lib.sh san_build: clang, CPU only, ASan +
# UBSan + libFuzzer coverage, ${KVCD_SAN_BUILD_DIR:-build-san}); it builds the fuzz targets
# too, so scripts/test-fuzz.sh after it compiles nothing. The two test binaries run side by
# side (one per core); a failure prints that binary's log.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/test-lib.sh
build=$(san_build_dir)
san_build "${SAN_TEST_TARGETS[@]}" "${FUZZ_TARGETS[@]}"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
pids=()
for t in "${SAN_TEST_TARGETS[@]}"; do
  "$build/tests/$t" --gtest_brief=1 >"$logs/$t.log" 2>&1 &
  pids+=($!)
done
failed=()
for i in "${!pids[@]}"; do
  t=${SAN_TEST_TARGETS[$i]}
  if wait "${pids[$i]}"; then
    echo "test-asan: $t: $(grep -E '^\[  PASSED  \]' "$logs/$t.log" || echo passed)"
  else
    cat "$logs/$t.log"
    failed+=("$t")
  fi
done
if ((${#failed[@]})); then
  echo "test-asan: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "test-asan: ${#SAN_TEST_TARGETS[@]} test binaries passed under ASan+UBSan"
