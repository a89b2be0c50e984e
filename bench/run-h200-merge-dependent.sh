#!/usr/bin/env bash
# Issue #36, one lease (~6 minutes), session 29: a forked call's merge as the history launch's
# programmatic dependent, waiting on the device for the side stream's word
# (KVCD_MERGE=dependent, the default now), against the merge launched after the daemon's
# stream joins the side stream (KVCD_MERGE=kernel, the default before), and the INT2 call as
# a CUDA graph against its stream launches. Most important first:
#   1. every CUDA kernel test (the merge's wait among them), the data-plane tests under both
#      merges (CUDA daemon against CPU daemon, per format, windows beside the history);
#   2. the per-layer decode loop through kvcd (bench/run-decode-batch.sh: INT2 history 32k /
#      100k, BF16 history 32k, int2-transform 32k / 100k where its codec could be made;
#      batch 1 and 8; fused producer, IPC-event hops), dependent and kernel merges
#      alternated twice, each run beside the in-process cuDNN loop of the same lease;
#   3. the INT2 call alone at 32k / 100k batch 1: stream launches against the same call
#      captured as a CUDA graph (cuda_int2_bench --one);
#   4. a worker killed mid-step (bench/run-h200-worker-death.sh) under the new merge.
#   (compute-sanitizer memcheck and racecheck on the merge tests after step 1's tests.)
#   here:   T="kvcd kvctl kvcd_cuda_tests kvcd_data_plane_tests kvcd_prefill_worker
#             kvcd_decode_worker cuda_int2_bench kvcd-calibrate kvcd-int2-study" and the
#           recipe of bench/run-device-parts.sh (with etcd: xz -1 -c /usr/bin/etcd >
#           .devbin/etcd.xz before the tarball)
#   device: bench/run-device-parts.sh merge-dependent:540   (carry [".devrun"])
# KVCD_MERGE_AB_ONLY=1: the CUDA kernel tests and step 2 alone, KVCD_MERGE_ROUNDS (2) rounds. The decode runs never
# time the daemon's phases (KVCD_LOOP_PHASES=0 here): the GPU timeline's events on both
# streams break the programmatic launches this compares (session 29's first run had them on
# and measured nothing but the instrumentation).
# Writes $OUT/summary.txt and $OUT/logs.tgz.
set -uo pipefail
export KVCD_LOOP_PHASES=0
ab_only=${KVCD_MERGE_AB_ONLY:-0}
cd "$(dirname "$0")/.."
source bench/device-steps.sh
device_steps merge-dependent
source bench/device-etcd.sh  # the data-plane tests' cluster pulls start etcd

# The int2-transform model's codec file (synthetic: timing only), made while step 1 runs.
xform_codec_start /tmp/kvcd-qwen3-8b-synthetic-transform-codec.safetensors

# 1. tests
step cuda-tests 150 "$BIN/kvcd_cuda_tests"
grep -E 'Failure|actual:|exceeds' "$out/cuda-tests.log" | head -12 | tee -a "$final/summary.txt"
if [[ $ab_only != 1 ]]; then
for merge in dependent kernel; do
  KVCD_MERGE=$merge KVCD_BINARY=$BIN/kvcd step data-plane-$merge 120 \
    "$BIN/kvcd_data_plane_tests"
  grep -hE 'CUDA vs CPU' "$out/data-plane-$merge.log" | head -8 | tee -a "$final/summary.txt"
done

# the merge's wait under compute-sanitizer (memcheck, then racecheck on its shared memory)
for tool in memcheck racecheck; do
  step sanitizer-$tool 60 compute-sanitizer --tool "$tool" --error-exitcode 9 \
    "$BIN/kvcd_cuda_tests" --gtest_filter='*MergeWaits*:*MergePoisons*'
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|hazard' "$out/sanitizer-$tool.log" | head -4 |
    tee -a "$final/summary.txt"
done
fi

# 2. the decode loop, both merges alternated
xform_loop_setup 52GiB
for round in $(seq 1 "${KVCD_MERGE_ROUNDS:-2}"); do
  for merge in dependent kernel; do
    KVCD_MERGE=$merge KVCD_CONFIG=$out/kvcd-int2.yaml KVCD_RUNS=$runs \
      KVCD_PUT_MODELS=qwen3-8b-xform KVCD_BATCHES="1 8" KVCD_HOPS=events KVCD_PRODUCERS=fused \
      OUT=$out/decode-$merge-$round step decode-$merge-$round 90 bench/run-decode-batch.sh
    summary "round $round, KVCD_MERGE=$merge:"
    grep -E '^\|' "$out/decode-$merge-$round.log" | tee -a "$final/summary.txt"
  done
done

[[ $ab_only == 1 ]] && { summary "done in $SECONDS s"; exit 0; }
# 3. the INT2 call alone, stream launches against a CUDA graph
for n in 32768 100000; do
  step int2-graph-$n 60 "$BIN/cuda_int2_bench" --bench-only --one "$n" 1 4
  grep -E "^ +$n " "$out/int2-graph-$n.log" | tee -a "$final/summary.txt"
done

# 4. a worker killed mid-step, the new merge
OUT=$out/worker-death step worker-death 120 bench/run-h200-worker-death.sh
grep -E '^(ok|FAILED|worker death|tokens/s)' "$out/worker-death.log" | tee -a "$final/summary.txt"
summary "done in $SECONDS s"
