#!/usr/bin/env bash
# The long fuzz campaign of #21 on a many-core machine: every libFuzzer target of tests/fuzz/
# runs until it has executed at least KVCD_FUZZ_RUNS (default 10^6) inputs in total, split
# over parallel jobs (libFuzzer -jobs/-workers: independent processes sharing one corpus
# directory), all targets at once. Stops a target at its first crash and keeps the
# reproducer. Binaries come from .devfuzz (scripts/pack-device.sh fuzz, after
# scripts/test-fuzz.sh built them in build-fuzz), their shared libraries from .devlibs.
#   bench/run-fuzz-campaign.sh            # on the device machine, repository root
# Writes a per-target summary (executions, seconds, crashes) to stdout and the logs to
# ${OUT:-/tmp}/fuzz-campaign/.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${KVCD_FUZZ_RUNS:-1000000}
max_seconds=${KVCD_FUZZ_MAX_SECONDS:-480}  # each job also stops here (the device call limit)
out=${OUT:-/tmp}/fuzz-campaign
bins=${KVCD_FUZZ_BIN_DIR:-.devfuzz}
export LD_LIBRARY_PATH="$PWD/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
cores=$(nproc)
# Jobs per target, by cost per execution (the RPC and decode-channel targets run a real
# engine per input and are 10-50x slower than the readers).
declare -A share=([config_fuzz]=2 [safetensors_fuzz]=1 [codec_profile_fuzz]=1
  [activation_dump_fuzz]=1 [rpc_fuzz]=4 [decode_channel_fuzz]=6)
total=0
for t in "${!share[@]}"; do total=$((total + share[$t])); done
mkdir -p "$out"
start=$SECONDS
for t in "${!share[@]}"; do
  jobs=$(((share[$t] * cores + total - 1) / total))
  per_job=$(((runs + jobs - 1) / jobs))
  mkdir -p "$out/$t/corpus" "$out/$t/logs"
  (
    cd "$out/$t/logs" &&
      "$OLDPWD/$bins/$t" -jobs="$jobs" -workers="$jobs" -runs="$per_job" -max_total_time="$max_seconds" -timeout=10 \
        -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$out/$t/crash-" \
        "$out/$t/corpus" "$OLDPWD/tests/fuzz/corpus/$t" >"$out/$t/driver.log" 2>&1
  ) &
done
wait
status=0
printf '| target | jobs | executions | seconds | crashes |\n|---|---:|---:|---:|---:|\n'
for t in config_fuzz safetensors_fuzz codec_profile_fuzz activation_dump_fuzz rpc_fuzz \
    decode_channel_fuzz; do
  jobs=$(((share[$t] * cores + total - 1) / total))
  execs=$(cat "$out/$t"/logs/fuzz-*.log 2>/dev/null |
    sed -n 's/^stat::number_of_executed_units: *//p' | awk '{s += $1} END {print s + 0}')
  crashes=$(find "$out/$t" -maxdepth 1 -name 'crash-*' | wc -l)
  secs=$(grep -h 'Done [0-9]* runs in [0-9]* second' "$out/$t"/logs/fuzz-*.log |
    sed 's/.* in \([0-9]*\) second.*/\1/' | sort -n | tail -1)
  printf '| %s | %d | %d | %s | %d |\n' "$t" "$jobs" "$execs" "${secs:-?}" "$crashes"
  ((crashes == 0 && execs >= runs)) || status=1
done
echo "wall: $((SECONDS - start)) s on $cores cores"
exit $status
