#!/usr/bin/env bash
# The libFuzzer targets of tests/fuzz/, built in the one instrumented build the sanitized unit
# tests share (scripts/test-lib.sh san_build: clang, CPU only, ASan + UBSan + libFuzzer
# coverage, ${KVCD_SAN_BUILD_DIR:-build-san}; after scripts/test-asan.sh nothing is left to
# compile). Replays each target's committed corpus (tests/fuzz/corpus/<target>/), then fuzzes
# within a fixed total budget: KVCD_FUZZ_BUDGET seconds of wall time (default 30) for all the
# targets, KVCD_FUZZ_JOBS of them at a time (default: the number of cores), so each gets
# budget x jobs / targets seconds (9 s with 7 targets on 2 cores); KVCD_FUZZ_SECONDS sets
# the seconds per target instead. Any crash, leak, sanitizer report or timeout fails the
# script and leaves the reproducer in $build/fuzz-artifacts/.
#   scripts/test-fuzz.sh                    # build, replay, fuzz every target
#   KVCD_FUZZ_SECONDS=0 scripts/test-fuzz.sh   # build and replay only
#   scripts/test-fuzz.sh config_fuzz        # one target
#   KVCD_FUZZ_RUNS=1000000 scripts/test-fuzz.sh   # a campaign: 10^6 executions per target
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/test-lib.sh
build=$(san_build_dir)
runs=${KVCD_FUZZ_RUNS:-}
jobs=${KVCD_FUZZ_JOBS:-$(nproc)}
targets=("$@")
((${#targets[@]})) || targets=("${FUZZ_TARGETS[@]}")
budget=${KVCD_FUZZ_BUDGET:-30}
((jobs <= ${#targets[@]})) || jobs=${#targets[@]}
seconds=${KVCD_FUZZ_SECONDS:-$(((budget * jobs + ${#targets[@]} - 1) / ${#targets[@]}))}
san_build "${targets[@]}"

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
artifacts="$PWD/$build/fuzz-artifacts"
mkdir -p "$artifacts"

fuzz_one() {  # TARGET: replay, then fuzz; prints one line; the status says whether it passed
  local t=$1
  local bin="$build/tests/fuzz/$t" corpus=tests/fuzz/corpus/$t
  local work="$build/fuzz-corpus/$t"  # inputs found while fuzzing (not committed)
  local log="$build/fuzz-$t.log"
  mkdir -p "$work"
  # Replay: every committed seed runs once (no mutation).
  if ! "$bin" -runs=0 -artifact_prefix="$artifacts/$t-" "$corpus" >"$log" 2>&1; then
    tail -n 40 "$log"; echo "test-fuzz: $t: a committed seed fails" >&2; return 1
  fi
  local replayed
  replayed=$(find "$corpus" -type f | wc -l)
  if ((seconds <= 0)) && [[ -z $runs ]]; then
    echo "== $t: replayed $replayed seeds"
    return 0
  fi
  local limit=(-max_total_time="$seconds")
  # decode_channel_fuzz checks for leaks at exit (its serving threads joined), not after each
  # input: LeakSanitizer looks a live thread up by its kernel thread id, and where ids are
  # recycled fast (each corrupt channel gets a new serving thread) it can miss the live serving
  # thread ("Thread N not found in registry" with LSAN_OPTIONS=log_threads=1) and report that
  # thread's locals as leaked (bench/results/2026-12-05-fuzz-leak-finding.md).
  [[ $t == decode_channel_fuzz ]] && limit+=(-detect_leaks=0)
  [[ -n $runs ]] && limit=(-runs="$runs")
  local start=$SECONDS
  if ! "$bin" "${limit[@]}" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="$artifacts/$t-" "$work" "$corpus" >"$log" 2>&1; then
    tail -n 40 "$log"; echo "test-fuzz: $t: crash (reproducer in $artifacts)" >&2; return 1
  fi
  echo "== $t: replayed $replayed seeds; fuzzed $((SECONDS - start)) s:" \
    "$(sed -n 's/^stat::number_of_executed_units: *//p' "$log") executions, no crash"
}

# At most $jobs targets at a time; each one's lines print when it ends.
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
running=0
for t in "${targets[@]}"; do
  if ((running >= jobs)); then
    wait -n || true
    running=$((running - 1))
  fi
  ( if fuzz_one "$t" >"$results/$t.out" 2>&1; then touch "$results/$t.ok"; fi
    cat "$results/$t.out" ) &
  running=$((running + 1))
done
wait
failed=()
for t in "${targets[@]}"; do [[ -f $results/$t.ok ]] || failed+=("$t"); done
if ((${#failed[@]})); then
  echo "test-fuzz: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "test-fuzz: ${#targets[@]} targets, no crash (${seconds} s of fuzzing each, $jobs at a time)"
