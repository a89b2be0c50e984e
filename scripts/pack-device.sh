#!/usr/bin/env bash
# Packs what the device runs need (bench/run-data-plane.sh, bench/run-h200-daemon.sh) after a
# build: stripped binaries into .devbin and their non-system shared libraries (every ldd
# dependency except glibc, libstdc++, libgcc and zlib, which the device has) into .devlibs.
# Both folders are ignored by git; the device tool carries them.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
bins=(server/kvcd client/kvctl bench/kvcd_load client/examples/kvcd_demo
      client/workers/kvcd_prefill_worker client/workers/kvcd_decode_worker
      tests/kvcd_data_plane_tests tests/kvcd_cuda_tests bench/cuda_int2_bench
      bench/cuda_finite_check_bench)
rm -rf .devbin .devlibs && mkdir -p .devbin .devlibs
for b in "${bins[@]}"; do
  strip -o ".devbin/$(basename "$b")" "$build/$b"
  ldd "$build/$b" | awk '/=> \//{print $3}'
done | sort -u | grep -vE '/(libc|libm|libgcc_s|libstdc\+\+|libz|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" .devlibs/; done
du -sh .devbin .devlibs
