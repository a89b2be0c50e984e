#!/usr/bin/env bash
# The long fuzz campaign of #21 on a many-core machine: every libFuzzer target of tests/fuzz/
# runs until it has executed at least KVCD_FUZZ_RUNS (default 10^6) inputs in total, split
# over parallel jobs (libFuzzer -jobs/-workers: independent processes sharing one corpus
# directory), all targets at once. Stops a target at its first crash and keeps the
# reproducer. Binaries come from .devfuzz (scripts/pack-device.sh fuzz, after
# scripts/test-fuzz.sh built them in build-san), their shared libraries from .devlibs.
#   bench/run-fuzz-campaign.sh            # on the device machine, repository root
#   bench/run-fuzz-campaign.sh rpc_fuzz   # only some targets
# Prints a per-target summary (executions, seconds, crashes); works in /tmp/fuzz-campaign/;
# copies each target's first two reproducers and its first crash report (sanitizer stack)
# to ${OUT:-/tmp} (fuzz-<target>-crash-*, fuzz-<target>-report.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${KVCD_FUZZ_RUNS:-1000000}
max_seconds=${KVCD_FUZZ_MAX_SECONDS:-480}  # each job also stops here (the device call limit)
out=/tmp/fuzz-campaign
keep=${OUT:-/tmp}
bins=${KVCD_FUZZ_BIN_DIR:-.devfuzz}
export LD_LIBRARY_PATH="$PWD/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=1
# KVCD_FUZZ_VERBOSITY=1 adds the sanitizers' verbosity=1: LeakSanitizer then logs every thread
# it could not stop for a leak check ("Could not attach to thread"); a thread it did not stop
# is not scanned, so what only that thread's stack holds is reported as leaked.
if [[ -n ${KVCD_FUZZ_VERBOSITY:-} ]]; then
  ASAN_OPTIONS+=":verbosity=$KVCD_FUZZ_VERBOSITY"
fi
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
cores=$(nproc)
# Jobs per target, by cost per execution (the RPC and decode-channel targets run a real
# engine per input and are 10-50x slower than the readers).
declare -A share=([config_fuzz]=2 [safetensors_fuzz]=1 [codec_profile_fuzz]=1
  [activation_dump_fuzz]=1 [rpc_fuzz]=4 [decode_channel_fuzz]=6)
if (($#)); then  # only the named targets, sharing the cores the same way
  declare -A picked=()
  for t in "$@"; do picked[$t]=${share[$t]:?unknown target $t}; done
  unset share && declare -A share=() && for t in "${!picked[@]}"; do share[$t]=${picked[$t]}; done
fi
# libFuzzer's per-input leak check (-detect_leaks=1) for every target but decode_channel_fuzz,
# which is checked at exit (scripts/test-fuzz.sh says why: LeakSanitizer misses a live thread
# whose kernel thread id was recycled, bench/results/2026-12-05-fuzz-leak-finding.md).
# KVCD_FUZZ_DETECT_LEAKS=0/1 sets it for every target. ASan's own checks stay on.
leak_flag_for() {
  local d=${KVCD_FUZZ_DETECT_LEAKS:-}
  [[ -z $d ]] && { [[ $1 == decode_channel_fuzz ]] && d=0 || d=1; }
  echo "-detect_leaks=$d"
}
total=0
for t in "${!share[@]}"; do total=$((total + share[$t])); done
rm -rf "$out" && mkdir -p "$out"
start=$SECONDS
for t in "${!share[@]}"; do
  jobs=$(((share[$t] * cores + total - 1) / total))
  per_job=$(((runs + jobs - 1) / jobs))
  mkdir -p "$out/$t/corpus" "$out/$t/logs"
  (
    cd "$out/$t/logs" &&
      "$OLDPWD/$bins/$t" -jobs="$jobs" -workers="$jobs" -runs="$per_job" -max_total_time="$max_seconds" -timeout=10 "$(leak_flag_for "$t")" \
        -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$out/$t/crash-" \
        "$out/$t/corpus" "$OLDPWD/tests/fuzz/corpus/$t" >"$out/$t/driver.log" 2>&1
  ) &
done
wait
status=0
printf '| target | jobs | executions | seconds | crashes |\n|---|---:|---:|---:|---:|\n'
for t in config_fuzz safetensors_fuzz codec_profile_fuzz activation_dump_fuzz rpc_fuzz \
    decode_channel_fuzz; do
  [[ -n ${share[$t]:-} ]] || continue
  jobs=$(((share[$t] * cores + total - 1) / total))
  execs=$(cat "$out/$t"/logs/fuzz-*.log 2>/dev/null |
    sed -n 's/^stat::number_of_executed_units: *//p' | awk '{s += $1} END {print s + 0}')
  crashes=$(find "$out/$t" -maxdepth 1 -name 'crash-*' | wc -l)
  secs=$(grep -h 'Done [0-9]* runs in [0-9]* second' "$out/$t"/logs/fuzz-*.log |
    sed 's/.* in \([0-9]*\) second.*/\1/' | sort -n | tail -1)
  printf '| %s | %d | %d | %s | %d |\n' "$t" "$jobs" "$execs" "${secs:-?}" "$crashes"
  if ((crashes > 0)); then
    find "$out/$t" -maxdepth 1 -name 'crash-*' | head -2 | while read -r f; do
      cp "$f" "$keep/fuzz-$t-$(basename "$f")"
    done
    report=$(grep -l 'ERROR:\|==ERROR\|runtime error' "$out/$t"/logs/fuzz-*.log | head -1)
    # (with the 8 lines before it: what LeakSanitizer logged while stopping threads)
    [[ -n $report ]] && grep -B 8 -A 60 -m 1 'ERROR\|runtime error' "$report" >"$keep/fuzz-$t-report.txt"
  fi
  # Leak reports beside the threads LeakSanitizer failed to stop in the same process.
  leaks=$(grep -l 'detected memory leaks' "$out/$t"/logs/fuzz-*.log 2>/dev/null | wc -l)
  if ((leaks > 0)); then
    unstopped=$(grep -l 'detected memory leaks' "$out/$t"/logs/fuzz-*.log |
      xargs grep -l 'Could not attach to thread\|Waiting on thread .* failed\|was not suspended' | wc -l)
    any=$(grep -l 'Could not attach to thread\|Waiting on thread .* failed\|was not suspended' "$out/$t"/logs/fuzz-*.log |
      wc -l)
    echo "$t: $leaks logs with leak reports, $unstopped of them also log a thread LeakSanitizer" \
      "could not stop ($any logs of $(ls "$out/$t"/logs/fuzz-*.log | wc -l) log one)"
    grep -h 'Could not attach to thread\|Waiting on thread .* failed\|was not suspended' "$out/$t"/logs/fuzz-*.log |
      sed 's/[0-9]\{2,\}/N/g' | sort | uniq -c >"$keep/fuzz-$t-unstopped.txt" || true
  fi
  ((crashes == 0 && execs >= runs)) || status=1
done
echo "wall: $((SECONDS - start)) s on $cores cores"
exit $status
