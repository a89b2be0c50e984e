# Sourced by scripts/test.sh and scripts/test-fast.sh: phases timed one by one (wall time and
# the CPU time of everything the phase ran, user + sys, from bash's `time`), a summary table,
# and the configuration of the one instrumented build (scripts/test-asan.sh, test-fuzz.sh).

# phase NAME COMMAND...: runs COMMAND, records PASS/FAIL with its times; returns its status.
# A phase started with `phase_bg` runs in the background with its output in a log file, printed
# (and its times recorded) by `phase_wait`.
_phase_names=() _phase_results=() _phase_failed=0
_phase_dir=$(mktemp -d "${TMPDIR:-/tmp}/kvcd-test-phases.XXXXXX")

_phase_run() {  # NAME TIMES_FILE COMMAND...: the command's status; "wall user sys" in TIMES_FILE
  local name=$1 times=$2 rc=0
  shift 2
  local TIMEFORMAT='%R %U %S'
  { time "$@" 2>&3 || rc=$?; } 3>&2 2>"$times"
  # `time` reports nothing when the command could not start; keep the table's columns.
  [[ -s $times ]] || echo "0 0 0" >"$times"
  return "$rc"
}

_phase_record() {  # NAME RC TIMES_FILE
  local name=$1 rc=$2 wall user sys
  read -r wall user sys <"$3"
  local cpu
  cpu=$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.1f", u + s }')
  wall=$(awk -v w="$wall" 'BEGIN { printf "%.1f", w }')
  _phase_names+=("$name")
  if ((rc == 0)); then
    _phase_results+=("$(printf '%-5s %-22s %7s s wall %8s s cpu' PASS "$name" "$wall" "$cpu")")
  else
    _phase_results+=("$(printf '%-5s %-22s %7s s wall %8s s cpu (exit %d)' FAIL "$name" "$wall" "$cpu" "$rc")")
    _phase_failed=$((_phase_failed + 1))
  fi
}

phase() {
  local name=$1 rc=0
  shift
  echo "=== $name: $*"
  _phase_run "$name" "$_phase_dir/$name.times" "$@" || rc=$?
  _phase_record "$name" "$rc" "$_phase_dir/$name.times"
  ((rc == 0)) || echo "=== $name: FAILED (exit $rc)" >&2
  return "$rc"
}

phase_bg() {  # NAME COMMAND...: started now; phase_wait NAME collects it. COMMAND may be a
  # function that runs phases of its own (`phase`): they are recorded too, after NAME's line.
  local name=$1
  shift
  echo "=== $name (background, log $_phase_dir/$name.log): $*"
  (
    _phase_names=() _phase_results=() _phase_failed=0
    rc=0
    _phase_run "$name" "$_phase_dir/$name.times" "$@" >"$_phase_dir/$name.log" 2>&1 || rc=$?
    ((${#_phase_results[@]} == 0)) || printf '%s\n' "${_phase_results[@]}" >"$_phase_dir/$name.inner"
    echo "$_phase_failed" >"$_phase_dir/$name.inner-failed"
    echo "$rc" >"$_phase_dir/$name.rc"
  ) &
  eval "_phase_pid_${name//[^A-Za-z0-9_]/_}=$!"
}

phase_wait() {  # NAME: waits for a background phase, prints its log, records it (and the
  # phases it ran); returns its status
  local name=$1 var="_phase_pid_${1//[^A-Za-z0-9_]/_}" rc line
  wait "${!var}" || true
  rc=$(cat "$_phase_dir/$name.rc" 2>/dev/null || echo 1)
  echo "=== $name (background) output:"
  cat "$_phase_dir/$name.log"
  _phase_record "$name" "$rc" "$_phase_dir/$name.times"
  if [[ -f $_phase_dir/$name.inner ]]; then
    while IFS= read -r line; do _phase_results+=("  $line"); done <"$_phase_dir/$name.inner"
  fi
  _phase_failed=$((_phase_failed + $(cat "$_phase_dir/$name.inner-failed" 2>/dev/null || echo 0)))
  ((rc == 0)) || echo "=== $name: FAILED (exit $rc)" >&2
  return "$rc"
}

phase_summary() {  # prints the table; returns 1 if any phase failed
  local total=$SECONDS
  echo "--- phases (wall: elapsed; cpu: user + sys of everything the phase ran; background"
  echo "    phases overlap the ones after them)"
  printf '  %s\n' "${_phase_results[@]}"
  echo "  total wall $total s on $(nproc) cores, ${_phase_failed} failed"
  rm -rf "$_phase_dir"
  ((_phase_failed == 0))
}

# The one instrumented build: clang, ASan + UBSan, every library compiled with libFuzzer's
# coverage (-fsanitize=fuzzer-no-link), CPU only, in ${KVCD_SAN_BUILD_DIR:-build-san}. The
# unit tests (scripts/test-asan.sh) and the fuzz targets (scripts/test-fuzz.sh) link the same
# objects, so they are compiled once. Debug (assertions on) with line tables only: the
# sanitizers' stack traces need file:line, not the full debug info that makes every compile
# and link of this build heavier. A unity build (KVCD_SAN_UNITY=OFF turns it off): nobody
# edits in this build dir, and each target's sources compiled a few per translation unit
# parse the gRPC/protobuf/Abseil headers once per batch. What computes (the kernels, the
# codecs and parsers of common/, the calibration tools) is compiled at -O1 (their
# CMakeLists.txt); everything else, the daemon's server code and the tests' own code, at -O0:
# under ASan + UBSan a server source costs 40% less at -O0 (server/rpc's unity file: 11.0
# CPU-s at -O1, 6.5 at -O0) and the unit tests' time is in the kernels and codecs.
# san_build TARGET... configures it and builds them.
san_build_dir() { echo "${KVCD_SAN_BUILD_DIR:-build-san}"; }
san_build() {
  local build
  build=$(san_build_dir)
  export CCACHE_DIR=${CCACHE_DIR:-$PWD/.cache/ccache}
  CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
    -DKVCD_SANITIZER=asan -DKVCD_CUDA=OFF -DKVCD_BUILD_TESTS=ON -DKVCD_BUILD_BENCH=OFF \
    -DKVCD_BUILD_FUZZ=ON "-DCMAKE_CXX_FLAGS=-O0 -fsanitize=fuzzer-no-link -Wno-unknown-warning-option" \
    "-DCMAKE_C_FLAGS=-O0 -fsanitize=fuzzer-no-link" -DCMAKE_CXX_FLAGS_DEBUG=-gline-tables-only \
    -DCMAKE_C_FLAGS_DEBUG=-gline-tables-only "-DCMAKE_UNITY_BUILD=${KVCD_SAN_UNITY:-ON}" -DCMAKE_UNITY_BUILD_BATCH_SIZE=16 >/dev/null
  local args=()
  for t in "$@"; do args+=(--target "$t"); done
  cmake --build "$build" -j "$(nproc)" "${args[@]}"
}
# What both scripts build: the sanitized unit tests and every fuzz target.
SAN_TEST_TARGETS=(kvcd_unit_tests kvcd_tools_tests)
FUZZ_TARGETS=(config_fuzz safetensors_fuzz codec_profile_fuzz activation_dump_fuzz
  decode_channel_fuzz rpc_fuzz codec_register_fuzz)

# ThreadSanitizer (tsan_phase, one phase of scripts/test.sh): clang, -fsanitize=thread, CPU
# only, in ${KVCD_TSAN_BUILD_DIR:-build-tsan}; a unity build of only the daemon and the unit
# and integration test binaries (Debug with line tables), so that it costs as little as a
# sanitizer build can: as in the ASan build, what computes (kernels, common, tools) is
# compiled at -O1 and the rest, the daemon's server code and the tests, at -O0 (under TSan a
# server source costs a third less at -O0: server/cluster's unity file 16.1 CPU-s at -O1,
# 10.0 at -O0). The unit tests and the integration tests (which start this build's
# TSan-instrumented daemon, and include the concurrency stress test,
# tests/integration/concurrency_stress_test.cc) run side by side; every process writes its
# reports under one folder (TSAN_OPTIONS log_path), and any report fails the phase, even one
# from a daemon whose test passed. gRPC, protobuf and Abseil are the distribution's
# uninstrumented builds: ignore_noninstrumented_modules leaves their own accesses out, and
# scripts/tsan.supp holds the suppressions for grpcpp's inline half, each with why.
# One test is left out: the decode channel whose shared memory the client truncates
# (SIGBUS, recovered by siglongjmp in server/dataplane/guarded_memory.cc). Under TSan the
# fault is taken inside the runtime's own memcpy interceptor, which holds the thread's
# shadow slot lock; jumping out of it leaves the lock held and the channel thread then
# deadlocks in the runtime (gdb: __tsan::SlotLock). Nothing of kvcd's locking is involved,
# and the unit test of the guarded copy (GuardedMemoryTest, one thread) runs.
TSAN_TARGETS=(kvcd kvcd_unit_tests kvcd_integration_tests)
TSAN_SKIP=HardeningTest.ACorruptOrTruncatedDecodeChannelCannotCrashTheDaemon
# The unit tests of the kernels (tests/unit/kernels/: framework-free math on one thread, no
# kernel starts a thread) are left out of the TSan run: they check the kernels against their
# oracles in CTest and under ASan + UBSan, and under TSan they took 40 of the unit tests' 49
# CPU-seconds with nothing for it to see. Their suites are read from the sources, so a new
# kernel test is left out too.
tsan_unit_filter() {
  local suites
  suites=$(sed -nE 's/^TEST(_F|_P)?\(([A-Za-z0-9_]+),.*/\2/p' tests/unit/kernels/*.cc | sort -u |
    sed 's/$/.*/' | paste -sd: -)
  echo "-$suites"
}
tsan_phase() {
  local build=${KVCD_TSAN_BUILD_DIR:-build-tsan} reports rc=0
  export CCACHE_DIR=${CCACHE_DIR:-$PWD/.cache/ccache}
  CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
    -DKVCD_SANITIZER=tsan -DKVCD_CUDA=OFF -DKVCD_BUILD_TESTS=ON -DKVCD_BUILD_BENCH=OFF \
    -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=16 \
    "-DCMAKE_CXX_FLAGS=-O0 -Wno-unknown-warning-option" -DCMAKE_CXX_FLAGS_DEBUG=-gline-tables-only \
    -DCMAKE_C_FLAGS_DEBUG=-gline-tables-only >/dev/null || return 1
  local args=()
  for t in "${TSAN_TARGETS[@]}"; do args+=(--target "$t"); done
  cmake --build "$build" -j "$(nproc)" "${args[@]}" || return 1
  reports=$(mktemp -d "${TMPDIR:-/tmp}/kvcd-tsan.XXXXXX")
  (
    export TSAN_OPTIONS="log_path=$reports/tsan halt_on_error=0 second_deadlock_stack=1 ignore_noninstrumented_modules=1 suppressions=$PWD/scripts/tsan.supp"
    "$build/tests/kvcd_unit_tests" --gtest_brief=1 "--gtest_filter=$(tsan_unit_filter)" >"$reports/unit.log" 2>&1 &
    local unit=$!
    "$build/tests/kvcd_integration_tests" --gtest_brief=1 "--gtest_filter=-$TSAN_SKIP" >"$reports/integration.log" 2>&1 &
    local integration=$! failed=0
    wait "$unit" || { cat "$reports/unit.log"; failed=1; }
    wait "$integration" || { cat "$reports/integration.log"; failed=1; }
    exit "$failed"
  ) || rc=1
  grep -h -E '^\[  PASSED  \]' "$reports/unit.log" "$reports/integration.log" | sed 's/^/tsan: /'
  if compgen -G "$reports/tsan.*" >/dev/null; then
    cat "$reports"/tsan.*
    echo "tsan: $(cat "$reports"/tsan.* | grep -c '^WARNING: ThreadSanitizer') reports" >&2
    rc=1
  fi
  rm -rf "$reports"
  return "$rc"
}
