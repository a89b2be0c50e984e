#!/usr/bin/env bash
# Packs what the device runs need (bench/run-data-plane.sh, bench/run-h200-daemon.sh) after a
# build: stripped binaries into .devbin and their non-system shared libraries (every ldd
# dependency except glibc, libstdc++, libgcc and zlib, which the device has) into .devlibs.
# Both folders are ignored by git; the device tool carries them.
#   scripts/pack-device.sh        # the daemon, workers, benches and device tests
#   scripts/pack-device.sh fuzz   # adds the libFuzzer targets of build-san into .devfuzz
#                                 # (bench/run-fuzz-campaign.sh), keeping .devbin/.devlibs
#   KVCD_PACK_ONLY="kvcd kvcd_cuda_tests" scripts/pack-device.sh
#                                 # only these binaries (by name), for a run that needs few
#                                 # (the device tool carries 64 MiB at most)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == fuzz ]]; then
  build=${KVCD_FUZZ_BUILD_DIR:-build-san}
  bins=(tests/fuzz/config_fuzz tests/fuzz/safetensors_fuzz tests/fuzz/codec_profile_fuzz
        tests/fuzz/activation_dump_fuzz tests/fuzz/rpc_fuzz tests/fuzz/decode_channel_fuzz
        tests/fuzz/codec_register_fuzz)
  dest=.devfuzz
  rm -rf .devfuzz && mkdir -p .devfuzz .devlibs
else
  build=${KVCD_BUILD_DIR:-build}
  bins=(server/kvcd client/kvctl bench/kvcd_load examples/kvcd_demo
        client/workers/kvcd_prefill_worker client/workers/kvcd_decode_worker
        tests/kvcd_data_plane_tests tests/kvcd_cuda_tests bench/cuda_int2_bench
        bench/cuda_finite_check_bench bench/cuda_doorbell_bench bench/cuda_host_cost_bench
        bench/cuda_fsq_bench bench/cuda_demote_bench bench/cuda_bf16_split_bench
        bench/cuda_transform_bench bench/cuda_job_bench bench/cuda_fsq_encode_bench
        bench/cluster_xfer_bench tools/kvcd-calibrate tools/kvcd-int2-study)
  dest=.devbin
  rm -rf .devbin .devlibs && mkdir -p .devbin .devlibs
fi
if [[ -n ${KVCD_PACK_ONLY:-} ]]; then
  only=()
  for b in "${bins[@]}"; do
    [[ " $KVCD_PACK_ONLY " == *" $(basename "$b") "* ]] && only+=("$b")
  done
  bins=("${only[@]}")
fi
for b in "${bins[@]}"; do
  strip -o "$dest/$(basename "$b")" "$build/$b"
  ldd "$build/$b" | awk '/=> \//{print $3}'
done | sort -u | grep -vE '/(libc|libm|libgcc_s|libstdc\+\+|libz|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" .devlibs/; done
# The request trace's prompt lengths for cuda_job_bench / job_baseline.py on the device (only
# input_length of each line; the trace itself is never committed).
if [[ $dest == .devbin ]]; then
  for t in "${KVCD_TRACE:-}" ../shared/data/traces/mooncake_synthetic_trace.jsonl \
    ../../shared/data/traces/mooncake_synthetic_trace.jsonl; do
    if [[ -n $t && -f $t ]]; then
      sed -nE 's/.*"input_length": *([0-9]+).*/{"input_length": \1}/p' "$t" > .devbin/trace-lengths.jsonl
      break
    fi
  done
fi
du -sh "$dest" .devlibs
