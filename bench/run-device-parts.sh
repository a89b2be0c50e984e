#!/usr/bin/env bash
# Runs several bench/run-h200-*.sh scripts in one device call, each under its own time budget
# and inside the call's own limit, most important first. A call costs a machine start and
# the device tool allows 10 minutes a command, so the runs that need the same binaries go
# together:
#   bench/run-device-parts.sh fsq-keys:330 fsq-enc:250
#   bench/run-device-parts.sh gpu-step:400 vllm-gpu:180
# Each part NAME runs bench/run-h200-NAME.sh with its own OUT folder; after each part, $OUT
# gets two files (the device tool returns 8 at most): summary.txt (the parts' summaries, one
# after another) and parts.tgz (every part's folder: its logs.tgz and tables). A part is cut
# at its budget or where the call's limit (KVCD_CALL_LIMIT_S, default 590 s) would be passed. Binaries: .devbin/.devlibs, or a
# packed tarball (KVCD_PACK, default .devrun/pack.tar.xz) unpacked into the checkout first.
#   here:   ./scripts/build.sh <targets> && KVCD_PACK_ONLY="<targets>" ./scripts/pack-device.sh
#           && tar -cJf .devrun/pack.tar.xz .devbin .devlibs   (.devrun ignored via
#           .git/info/exclude; carry [".devrun"], plus ".whl" for vllm-gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
final=${OUT:-/tmp/kvcd-device-parts-out}
limit=${KVCD_CALL_LIMIT_S:-590}
parts=/tmp/kvcd-device-parts
rm -rf "$parts" && mkdir -p "$final" "$parts"
: > "$final/summary.txt"
pack=${KVCD_PACK:-.devrun/pack.tar.xz}
if [[ -f $pack ]]; then
  tar -xJf "$pack" || { echo "cannot unpack $pack"; exit 1; }
fi
status=0
for part in "$@"; do
  name=${part%%:*}
  budget=${part##*:}
  left=$((limit - SECONDS - 5))
  ((budget > left)) && budget=$left
  if ((budget < 20)); then
    echo "== $name: skipped ($left s left of the call)" | tee -a "$final/summary.txt"
    continue
  fi
  mkdir -p "$parts/$name"
  t0=$SECONDS
  # To a file, not a pipe: a process a part leaves behind (etcd, MPS) cannot hold it open.
  OUT=$parts/$name timeout --kill-after=5 "$budget" "bench/run-h200-$name.sh" \
    > "$parts/$name/stdout.log" 2>&1
  rc=$?
  ((rc != 0)) && status=1
  # MPS (started by the decode benches) must not outlive the part that started it.
  echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
  { echo "== $name: rc $rc in $((SECONDS - t0)) s (budget $budget s)"
    # A part that writes no summary.txt (fsq-merge prints its table): its last lines.
    cat "$parts/$name/summary.txt" 2>/dev/null || tail -60 "$parts/$name/stdout.log"
  } >> "$final/summary.txt"
  tar -czf "$final/parts.tgz" -C "$parts" .
done
cat "$final/summary.txt"
exit $status
