#!/usr/bin/env bash
# The per-layer decode loop through kvcd at batch 1, 8 and 64 (issue #19: "batch 8 and 64
# reported too"), beside the in-process cuDNN loop at the same batch: one decode worker
# drives B sequences opened on the same cached prompt, one AttentionDecode call per layer
# for all of them (decode channel, CUDA IPC tensors, pipelined, MPS). INT2 and BF16
# history at 32k and 100k tokens; tokens/s counts every sequence's tokens.
#   here:   ./scripts/build.sh && ./scripts/pack-device.sh
#   device: bench/run-decode-batch.sh   (device tool, carry [".devbin", ".devlibs"])
# The batch's sequences share the cached prompt's pages (prefix sharing: their history reads
# partly hit L2, where cuDNN reads B separate caches); KVCD_DISTINCT=1 gives each sequence
# its own copy of the prompt instead (B prefills; memory allows INT2 up to B = 8 at 100k).
# KVCD_RUNS ("qwen3-8b-int2:32768 qwen3-8b-int2:99968 qwen3-8b:32768 qwen3-8b:99968"),
# KVCD_BATCHES ("1 8 64"), KVCD_STEPS (16), KVCD_HOPS ("events": the worker's --hops, e.g.
# "memops events" to run both orderings of the cross-process hops, issue #36), KVCD_PRODUCERS
# ("fused": the worker's --producer; "fused split" runs the per-layer q/k/v kernels as one
# launch and as the four of the loop before session 27, in one lease), KVCD_CONFIG
# (deploy/config/kvcd-decode-step.yaml: 90 GiB, INT2 and BF16 models), KVCD_PUT_MODELS
# (none: models whose prompt the prefill worker stores with --mode put, BF16 K/V quantized
# by the daemon, instead of pushing pages: an int2-transform or FSQ model, whose pages the
# push's INT2-layout fill does not make; an FSQ model's Put carries the residuals x too, in
# chunks of the worker's --put-chunk-tokens; the worker's first Put lands under --salt, so
# the decode workers open it as a pushed prompt, with KVCD_DISTINCT too). Rows are labelled
# by model name: *xform* int2-transform, *fsq* FSQ, *int2* INT2, else BF16. Writes
# $OUT/decode-batch.txt (the table last). About 90 s.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvcd-decode-batch}
mkdir -p "$out"
exec > >(tee "$out/decode-batch.txt") 2>&1
source scripts/daemon-lib.sh
# KVCD_LOOP_PHASES=1: the daemon times every phase of its calls (KVCD_PHASE_TIMES, host and
# GPU timeline; ~1 µs a phase) and reports them per decode channel into
# $out/kvcd-daemon.log; off by default, so the tokens/s are those of a daemon without it.
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs KVCD_PHASE_TIMES=${KVCD_LOOP_PHASES:-0}
BIN=${KVCD_BIN:-.devbin}
BATCHES=${KVCD_BATCHES:-1 8 64}
STEPS=${KVCD_STEPS:-16}
HOPS=${KVCD_HOPS:-events}
PRODUCERS=${KVCD_PRODUCERS:-fused}
nvidia-cuda-mps-control -d && echo "MPS on"
start_kvcd "$BIN/kvcd" "${KVCD_CONFIG:-deploy/config/kvcd-decode-step.yaml}" || exit 1
rc=0
rows=()
distinct=()
[[ ${KVCD_DISTINCT:-0} == 1 ]] && distinct=(--distinct-prompts)
max=1
for bsz in $BATCHES; do ((bsz > max)) && max=$bsz; done
for mt in ${KVCD_RUNS:-qwen3-8b-int2:32768 qwen3-8b-int2:99968 qwen3-8b:32768 qwen3-8b:99968}; do
  m=${mt%%:*}; t=${mt##*:}
  salts=("b$t")
  [[ ${#distinct[@]} -gt 0 ]] && salts=($(for i in $(seq 0 $((max - 1))); do echo "b$t-$i"; done))
  put=(); salt=b$t
  [[ " ${KVCD_PUT_MODELS:-} " == *" $m "* ]] && put=(--mode put)
  for s in "${salts[@]}"; do
    plog="$out/prefill-$m-$s.log"
    timeout 300 "$BIN/kvcd_prefill_worker" --target "$KVCD_GRPC" --model "$m" --tokens "$t" \
      --salt "$s" --repeat 1 "${put[@]}" >"$plog" 2>&1 ||
      { echo "$m $t: prefill worker failed ($plog):"; tail -3 "$plog"; rc=1; }
  done
  for bsz in $BATCHES; do
    for hops in $HOPS; do
      for prod in $PRODUCERS; do
        # The log name keeps its earlier form for the default producer.
        log="$out/decode-$m-$t-b$bsz-$hops$([[ $prod == fused ]] || echo "-$prod").log"
        timeout 300 "$BIN/kvcd_decode_worker" --target "$KVCD_GRPC" --model "$m" --tokens "$t" \
          --salt "$salt" --steps "$STEPS" --batch "$bsz" --io ipc --hops "$hops" \
          --producer "$prod" "${distinct[@]}" >"$log" 2>&1 || rc=1
        tps=$(sed -n 's/^tokens\/s: \([0-9.]*\).*/\1/p' "$log")
        match=$(grep -c ': match' "$log")
        echo "$m $t batch $bsz hops $hops producer $prod: ${tps:-?} tokens/s, IPC vs inline $([[ $match == 1 ]] && echo match || echo MISMATCH)"
        [[ $match == 1 ]] || rc=1
        rows+=("$m $t $bsz ${tps:-0} $hops/$prod")
      done
    done
  done
done
stop_kvcd; echo "daemon exit: $?"
[[ ${KVCD_LOOP_PHASES:-0} == 1 ]] && cat "$KVCD_LOG_DIR/out" "$KVCD_LOG_DIR/err" >"$out/kvcd-daemon.log"
timeout 200 python3 bench/sdpa_baseline.py --backends cudnn --contexts 32768 100000 \
  --batches $BATCHES > "$out/sdpa.txt" 2>&1 || rc=1
cat "$out/sdpa.txt"
echo
echo "| history | context | batch | hops / producer | kvcd tok/s | cuDNN loop tok/s (us per layer) | kvcd / cuDNN |"
echo "|---|---:|---:|---|---:|---:|---:|"
for r in "${rows[@]}"; do
  read -r m t bsz tps hops <<<"$r"
  ctx=$t; [[ $t == 99968 ]] && ctx=100000
  us=$(awk -v c="$ctx" -v b="$bsz" '$1 == "cudnn" && $2 == c && $3 == b { print $5 }' "$out/sdpa.txt")
  awk -v m="$m" -v t="$t" -v b="$bsz" -v k="$tps" -v us="${us:-0}" -v hops="$hops" 'BEGIN {
    h = (m ~ /xform/) ? "int2-transform" : (m ~ /fsq/) ? "FSQ" : (m ~ /int2/) ? "INT2" : "BF16"; c = us > 0 ? b * 1e6 / (36 * us) : 0;
    printf "| %s | %d | %d | %s | %.1f | %.1f (%.1f) | %.2fx |\n", h, t, b, hops, k, c, us, (c > 0 ? k / c : 0) }'
done
exit $rc
