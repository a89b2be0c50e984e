#!/usr/bin/env bash
# The third pass on the INT2 decode kernel (#20), on the H200 with carry [".devbin",
# ".devlibs"]: correctness first (kernel tests, the bench's CPU-oracle checks), then the new
# kernel's timings beside the previous commit's in the same lease (.devbin/
# cuda_int2_bench_prev, if packed: build commit PREV in a worktree with
# `./scripts/build.sh cuda_int2_bench` and strip it there), torch SDPA, Nsight Compute on
# batch 8 (both kernels) and on the three kernels of a batch-1 call, then the sanitizers and
# the data-plane tests. Logs go to /tmp/kvcd-h200-pass3, packed into $OUT/pass3-logs.tgz.
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh
#           strip -o .devbin/cuda_int2_bench_prev <prev worktree>/build/bench/cuda_int2_bench
#   device: bench/run-h200-int2-pass3.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=/tmp/kvcd-h200-pass3
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.devlibs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
step() {  # name, timeout, command...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" stdbuf -oL "$@" > "$out/$name.log" 2>&1
  echo "$name rc $? ($((SECONDS - t0)) s)"
}
step cuda-tests 120 .devbin/kvcd_cuda_tests
tail -2 "$out/cuda-tests.log"
step int2-bench 240 .devbin/cuda_int2_bench
grep -E "FAIL|ceiling" "$out/int2-bench.log"
sed -n '/^INT2 decode/,$p' "$out/int2-bench.log"
if [ -x .devbin/cuda_int2_bench_prev ]; then  # its default v2 configuration, one size at a time
  for n in 32768 100000; do
    for b in 1 8 64; do
      step "int2-bench-prev-$n-$b" 60 .devbin/cuda_int2_bench_prev --one $n $b 4
      grep -E "^ +$n " "$out/int2-bench-prev-$n-$b.log"
    done
  done
fi
# The fixed cost of a call: batch 1 at short contexts (a tile or a page per warp).
for n in 2048 8192; do
  step "int2-fixed-$n" 30 .devbin/cuda_int2_bench --one $n 1 4
  grep -E "^ +$n " "$out/int2-fixed-$n.log"
  if [ -x .devbin/cuda_int2_bench_prev ]; then
    step "int2-fixed-prev-$n" 30 .devbin/cuda_int2_bench_prev --one $n 1 4
    grep -E "^ +$n " "$out/int2-fixed-prev-$n.log"
  fi
done
[ "${KVCD_SKIP_SDPA:-0}" = 1 ] || step sdpa 120 python3 bench/sdpa_baseline.py
cat "$out/sdpa.log" 2>/dev/null | tail -12
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
          --section SchedulerStats --section LaunchStats --section Occupancy)
step ncu-b8 120 ncu --clock-control none -k regex:Int2DecodeKernelV2 -c 1 "${sections[@]}" \
  .devbin/cuda_int2_bench --one 100000 8 4
step ncu-b1 120 ncu --clock-control none -k 'regex:QueryFragments|Int2DecodeKernelV2|MergeSplits' \
  -c 3 "${sections[@]}" .devbin/cuda_int2_bench --one 100000 1 4
if [ -x .devbin/cuda_int2_bench_prev ]; then
  step ncu-b8-prev 120 ncu --clock-control none -k regex:Int2DecodeKernelV2 -c 1 "${sections[@]}" \
    .devbin/cuda_int2_bench_prev --one 100000 8 4
fi
for f in ncu-b8 ncu-b1 ncu-b8-prev; do
  [ -f "$out/$f.log" ] && grep -E "Int2Decode|QueryFrag|MergeSplits|Duration|DRAM Throughput|Issued Warp|Achieved Occupancy|Registers Per" "$out/$f.log" | sed "s/^/$f: /"
done
for tool in memcheck racecheck; do
  step "sanitizer-$tool" 150 compute-sanitizer --tool $tool .devbin/kvcd_cuda_tests \
    --gtest_filter='*Mixed*'
  tail -1 "$out/sanitizer-$tool.log"
done
KVCD_BINARY=.devbin/kvcd step data-plane-tests 150 .devbin/kvcd_data_plane_tests
tail -2 "$out/data-plane-tests.log"
[ -n "${OUT:-}" ] && tar -czf "$OUT/pass3-logs.tgz" -C "$out" .
