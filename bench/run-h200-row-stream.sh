#!/usr/bin/env bash
# Issue #36, one lease (~2-3 minutes): the per-layer decode loop through kvcd (INT2 history
# 32k / 100k, BF16 history 32k; batch 1 and 8; fused producer) with the merge kernel after
# the join of the two streams (KVCD_MERGE=kernel, the default until session 29) and folded (KVCD_MERGE=fold, its tail rewritten in session 28), each with the
# pipelined calls' row stores on the daemon's stream (KVCD_ROW_STREAM=main) and on the side
# stream beside the history's attention (side, the default since this part's session-28
# run), each beside the in-process cuDNN loop.
#   device: bench/run-device-parts.sh row-stream:230   (carry [".devrun"])
# Writes $OUT/summary.txt and $OUT/logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device-steps.sh
device_steps row-stream
# the fold's kernel tests first (its tail was rewritten after session 28's first run)
step fold-tests 60 "$BIN/kvcd_cuda_tests" \
  --gtest_filter='*MixedInt2AndBf16*:*FoldedMerge*:*TensorCoreDecodeMatchesTheOracle*'
decode_loop_config 40GiB > "$out/kvcd-int2.yaml"
runs="qwen3-8b-int2:32768 qwen3-8b-int2:99968 qwen3-8b:32768"
for merge in kernel fold; do
  for rs in main side; do
    KVCD_MERGE=$merge KVCD_ROW_STREAM=$rs KVCD_CONFIG=$out/kvcd-int2.yaml KVCD_RUNS=$runs \
      KVCD_BATCHES="1 8" KVCD_HOPS=events KVCD_PRODUCERS=fused OUT=$out/decode-$merge-$rs \
      step decode-$merge-$rs 60 bench/run-decode-batch.sh
    summary "merge $merge, row stores on the $rs stream (KVCD_MERGE=$merge KVCD_ROW_STREAM=$rs):"
    grep -E '^\|' "$out/decode-$merge-$rs.log" | tee -a "$final/summary.txt"
  done
done
summary "done in $SECONDS s"
