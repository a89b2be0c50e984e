#!/usr/bin/env bash
# The device run of FSQ models served from GPU memory (#16, serving half; < 2 minutes):
#   1. the FSQ data-plane tests: the real daemon (backend cuda) and a second one (backend
#      cpu) with the same FSQ model, driven by the real client: Put inline and over CUDA
#      IPC, the fused per-layer decode loop past two demotions (inline, and everything on
#      the device), PushPages over IPC, NaN/Inf residuals, an unsupported geometry;
#      stored bytes must be equal to the CPU backend's, attention close (the test prints
#      the largest error it saw);
#   2. the CUDA FSQ kernel tests against their CPU oracles (kvcd_cuda_tests *Fsq*);
#   3. the existing data-plane tests (INT2 / BF16 through the same backend code),
#      the NCCL and the lease-expiry tests left out;
#   4. end to end with kvctl against the real daemon: a model of Qwen3-8B's layer geometry
#      (4 layers, C = 4096, G = 256: 32x, key norm, RoPE) from a codec file, and the same
#      geometry with INT2 history beside it: put 4096 synthetic tokens, then 32 decode
#      steps of the per-layer fused loop over the gRPC stream (kvctl decode), per backend
#      (cuda, and cpu for the FSQ model as the reference of what it serves).
#   here:   ./scripts/build.sh kvcd kvcd_data_plane_tests kvcd_cuda_tests && ./scripts/pack-device.sh
#           (pack-device.sh packs every binary it lists: build them all, or the full build)
#   device: bench/run-h200-fsq-daemon.sh   (device tool, carry [".devbin", ".devlibs"])
# Writes $OUT/fsq-data-plane.log, fsq-kernels.log, data-plane.log, kvctl-*.log and
# summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvcd-h200-fsq}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs
BIN=${KVCD_BIN:-.devbin}
summary() { echo "$*" | tee -a "$out/summary.txt"; }
: > "$out/summary.txt"
summary "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
result() {  # name log rc
  summary "$1 rc $3: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?' "$2" | tr '\n' ' ')"
}
KVCD_BINARY=$BIN/kvcd timeout 100 "$BIN/kvcd_data_plane_tests" --gtest_filter='Formats/*.*/fsq_*' \
  > "$out/fsq-data-plane.log" 2>&1
result "FSQ data plane (cuda daemon vs cpu daemon)" "$out/fsq-data-plane.log" $?
grep -E '^fsq .*CUDA vs CPU' "$out/fsq-data-plane.log" | tee -a "$out/summary.txt"
timeout 30 "$BIN/kvcd_cuda_tests" --gtest_filter='*Fsq*' > "$out/fsq-kernels.log" 2>&1
result "FSQ kernels" "$out/fsq-kernels.log" $?
KVCD_BINARY=$BIN/kvcd timeout 60 "$BIN/kvcd_data_plane_tests" \
  --gtest_filter='Models/DataPlaneTest.*:-*Nccl*:*LeaseExpiry*' > "$out/data-plane.log" 2>&1
result "data plane (int2, bf16)" "$out/data-plane.log" $?
grep -hE '^\[  FAILED|Failure|rror' "$out/fsq-data-plane.log" "$out/fsq-kernels.log" \
  "$out/data-plane.log" | head -30

codec=$(mktemp -d)/codec.safetensors  # 25 MB: not in $OUT
python3 bench/fsq_synthetic_codec.py "$codec" --layers 4 --residual 4096 \
  --latent 256 --kv-heads 8 --head-dim 128 --key-norm
source scripts/daemon-lib.sh
for backend in cuda cpu; do
  cat > "$out/kvcd-$backend.yaml" <<YAML
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
backend: $backend
memory_budget: 4GiB
models:
  - {name: q3l4-fsq32, num_layers: 4, num_q_heads: 32, num_kv_heads: 8, head_dim: 128,
     page_size: 64, sink_tokens: 64, recent_tokens: 256, history_format: fsq,
     fsq_residual_width: 4096, fsq_latent_width: 256, key_norm: rms,
     rope: {theta: 1000000, rotary_dims: 128}, codec_file: $codec,
     memory: 1536MiB, bf16_fraction: 0.25}
  - {name: q3l4-int2, num_layers: 4, num_q_heads: 32, num_kv_heads: 8, head_dim: 128,
     page_size: 64, sink_tokens: 64, recent_tokens: 256, history_format: int2-oscar,
     memory: 1536MiB, bf16_fraction: 0.25}
YAML
  if ! start_kvcd "$BIN/kvcd" "$out/kvcd-$backend.yaml"; then
    summary "kvctl $backend: daemon did not start: $(tail -3 "$KVCD_LOG_DIR/err")"
    continue
  fi
  models="q3l4-fsq32 q3l4-int2"
  [[ $backend == cpu ]] && models=q3l4-fsq32
  for m in $models; do
    log="$out/kvctl-$backend-$m.log"
    { timeout 60 "$BIN/kvctl" --target "$KVCD_GRPC" put --model "$m" --synthetic 4096 --seed 7 &&
      timeout 60 "$BIN/kvctl" --target "$KVCD_GRPC" decode --model "$m" --synthetic 4096 \
        --seed 7 --steps 32; } > "$log" 2>&1
    summary "kvctl $backend $m rc $?: $(tail -2 "$log" | tr '\n' ' ')"
  done
  "$BIN/kvctl" --target "$KVCD_GRPC" models > "$out/kvctl-$backend-models.log" 2>&1
  stop_kvcd
  cp "$KVCD_LOG_DIR/err" "$out/kvcd-$backend.err"
done
