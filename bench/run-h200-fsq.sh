#!/usr/bin/env bash
# The device run of the CUDA FSQ kernels (issue 16): the FSQ kernel tests against the CPU
# definitions (encoder bit for bit, decode attention against the float64 oracle), memcheck
# and racecheck on small versions of them, then the FSQ decode attention and encoder
# figures (cuda_fsq_bench) against torch SDPA BF16 (cuDNN and flash, bench/sdpa_baseline.py)
# and the INT2 kernel (cuda_int2_bench --one, default variant) at the same geometry and
# contexts in the same run. About 2 minutes.
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh   (pack-device.sh packs every
#           device binary, so build them all)
#   device: bench/run-h200-fsq.sh   (device tool, carry [".devbin", ".devlibs"])
# KVCD_DEVBIN names another folder of the three binaries (default .devbin).
set -uo pipefail
out=${OUT:-/tmp/kvcd-h200-fsq}
mkdir -p "$out"
bin=${KVCD_DEVBIN:-.devbin}
export LD_LIBRARY_PATH=$PWD/.devlibs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
summary() { grep -E '^\[  (PASSED|FAILED)|^\[  SKIPPED' "$1" | tr '\n' ' '; }

timeout 120 "$bin"/kvcd_cuda_tests --gtest_filter='CudaFsq*' > "$out/fsq-tests.log" 2>&1
echo "fsq tests rc $?: $(summary "$out/fsq-tests.log")"
grep -E 'worst relative|Failure|FAILED' "$out/fsq-tests.log" | head -20
for tool in memcheck racecheck; do
  KVCD_FSQ_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 \
    "$bin"/kvcd_cuda_tests --gtest_filter='CudaFsq*' > "$out/$tool.log" 2>&1
  echo "$tool rc $?: $(summary "$out/$tool.log") $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log" | tail -1)"
done

timeout 150 "$bin"/cuda_fsq_bench > "$out/fsq-bench.txt" 2>&1
echo "cuda_fsq_bench rc $?"
cat "$out/fsq-bench.txt"

echo "== torch SDPA BF16 (same contexts, batch; K/V BF16)"
timeout 120 python3 bench/sdpa_baseline.py > "$out/sdpa.txt" 2>&1
echo "sdpa rc $?"
cat "$out/sdpa.txt"

echo "== INT2 kernel (cuda_int2_bench --one, v2, 4 CTAs per SM)"
for n in 32768 100000; do
  for b in 1 8 64; do
    timeout 30 "$bin"/cuda_int2_bench --one $n $b 4 2>&1 | grep -E "^ *$n +$b " 
  done
done | tee "$out/int2.txt"
