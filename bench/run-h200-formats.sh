#!/usr/bin/env bash
# The run behind bench/results/2026-12-03-h200-formats.md: the page-format redesign on the
# H200. Kernel tests (paged row stores bit-identical to the host codec) under memcheck, the
# data-plane tests against the daemon, then — for the daemon built from this tree and for
# the one before the redesign (.devbin/kvcd-before, optional) — Put of BF16 K/V over CUDA
# IPC, PushPages / FetchPages over CUDA IPC against a plain device-to-device copy, and the
# INT2 decode loop (under MPS when KVCD_MPS=1, as the earlier data-plane figures were);
# the main-job workload on the CUDA backend; the Python client's tests (.whl from
# scripts/pack-python-device.sh) against the CUDA daemon, torch CUDA IPC included.
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh  (+ strip an older kvcd into
#           .devbin/kvcd-before to compare)
#   device: bench/run-h200-formats.sh            (device tool, carry [".devbin", ".devlibs"])
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvcd-h200}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
.devbin/kvcd_cuda_tests > "$out/cuda-tests.log" 2>&1
echo "kvcd_cuda_tests rc $?: $(grep -E '^\[  (PASSED|FAILED)' "$out/cuda-tests.log" | tr '\n' ' ')"
compute-sanitizer --tool memcheck .devbin/kvcd_cuda_tests --gtest_filter='*PagedRowStores*' \
  > "$out/memcheck.log" 2>&1
echo "memcheck rc $?: $(tail -1 "$out/memcheck.log")"
KVCD_BINARY=.devbin/kvcd .devbin/kvcd_data_plane_tests > "$out/data-plane-tests.log" 2>&1
echo "kvcd_data_plane_tests rc $?: $(grep -E '^\[  (PASSED|FAILED)' "$out/data-plane-tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED' "$out/cuda-tests.log" "$out/data-plane-tests.log"
source scripts/daemon-lib.sh
if [ "${KVCD_MPS:-0}" = 1 ]; then nvidia-cuda-mps-control -d && echo "MPS on"; fi
for bin in kvcd kvcd-before; do
  [ -x ".devbin/$bin" ] || continue
  start_kvcd ".devbin/$bin" deploy/config/kvcd-dataplane.yaml || { cat "$KVCD_LOG_DIR/err"; continue; }
  echo "===== daemon $bin ($KVCD_GRPC)"
  for m in qwen3-8b-int2 qwen3-8b; do
    echo "--- $m: push/fetch 32768 tokens"
    timeout 120 .devbin/kvcd_prefill_worker --target "$KVCD_GRPC" --model $m --tokens 32768 \
      --salt "push-$m" --repeat 3 | grep -E 'push|fetch|plain|identical'
    for t in 4096 32768; do
      [ "$bin" = kvcd-before ] && [ $t -gt 4096 ] && continue  # the host path takes minutes
      echo "--- $m: put $t tokens over CUDA IPC"
      timeout 240 .devbin/kvcd_prefill_worker --target "$KVCD_GRPC" --model $m --tokens $t \
        --salt "put-$m-$t" --mode put --repeat 3 | grep -E 'put|plain|identical'
    done
  done
  echo "--- decode loop, qwen3-8b-int2, 32768 tokens (shared-memory channel)"
  timeout 120 .devbin/kvcd_decode_worker --target "$KVCD_GRPC" --model qwen3-8b-int2 \
    --tokens 32768 --salt push-qwen3-8b-int2 --steps 16 2>&1 | tail -4
  stop_kvcd; echo "daemon exit: $?"
  grep -iE 'error|fail' "$KVCD_LOG_DIR/err" | head -5
done
if [ "${KVCD_MPS:-0}" = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
echo "===== main-job workload on the CUDA backend"
start_kvcd .devbin/kvcd deploy/config/kvcd-h200.yaml || { cat "$KVCD_LOG_DIR/err"; exit 1; }
.devbin/kvcd_demo --target "$KVCD_GRPC" 2>&1 | tail -16
stop_kvcd; echo "daemon exit: $?"
if [ -d .whl ]; then
  echo "===== Python client tests against the CUDA daemon"
  ./scripts/test-python-device.sh > "$out/python.log" 2>&1
  echo "python tests rc $?"; tail -15 "$out/python.log"
fi
