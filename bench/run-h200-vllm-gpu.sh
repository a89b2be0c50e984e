#!/usr/bin/env bash
# Issue #33 on the GPU device, one call (~3 minutes): the vLLM connector's CUDA IPC path.
#   1. tests: client/python/tests/test_vllm_gpu.py (the connector's worker side with torch CUDA
#      tensors laid out as vLLM 0.32's GPU KV cache against the real CUDA daemon: stored and
#      loaded blocks equal, IPC save byte-identical to inline for int2-oscar, bad handle /
#      region errors, the buffer re-registered after the daemon dropped it, a CPU daemon
#      falling back inline, a dead daemon's load reported failed) and the client's existing
#      test_cuda_ipc.py;
#   2. the bench: IPC against inline, save and load latency and bytes/s, 1k / 4k / 16k-token
#      prefixes, Qwen3-8B's geometry (bench/vllm_gpu_transfer_bench.py);
#   3. the IPC tests again with the daemon under compute-sanitizer memcheck.
#   here:   ./scripts/build.sh kvcd && KVCD_PACK_ONLY="kvcd" ./scripts/pack-device.sh &&
#           ./scripts/pack-python-device.sh
#   device: bench/run-h200-vllm-gpu.sh   (carry [".devbin", ".devlibs", ".whl"])
# The image's torch, numpy and grpcio; protobuf and pytest from .whl; the kvcd wheel's
# generated stubs with this checkout's client sources on top. Writes $OUT/summary.txt,
# $OUT/bench.json and $OUT/logs.tgz (re-packed after every step).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
final=${OUT:-/tmp/kvcd-vllm-gpu}
out=/tmp/kvcd-vllm-gpu-logs
site=/tmp/kvcd-vllm-gpu-site
mkdir -p "$final" "$out"
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$root/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
py=${PYTHON:-python3}
summary() { echo "$*" | tee -a "$final/summary.txt"; }
pack() { tar -czf "$final/logs.tgz" -C "$out" . 2>/dev/null; }
step() {  # name, timeout, command...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" stdbuf -oL "$@" > "$out/$name.log" 2>&1
  local rc=$?
  summary "$name rc $rc ($((SECONDS - t0)) s): $(grep -E '^[0-9]+ (passed|failed)|(passed|failed|skipped|error)[^ ]* in ' "$out/$name.log" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$out/$name.log" | head -20 | tee -a "$final/summary.txt"
  pack
}
: > "$final/summary.txt"
summary "$(nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>&1)"

# The client: wheels into a private folder, this checkout's sources over the wheel's.
rm -rf "$site"
pkgs=(kvcd pytest iniconfig pluggy packaging pygments tomli exceptiongroup typing_extensions)
"$py" -c 'import google.protobuf' 2>/dev/null || pkgs+=(protobuf)
"$py" -m pip install -q --no-index --find-links .whl --target "$site" --no-deps "${pkgs[@]}" \
  > "$out/pip.log" 2>&1 || summary "pip install failed: $(tail -3 "$out/pip.log")"
cp -r client/python/src/kvcd/. "$site/kvcd/"
summary "$("$py" -c 'import torch, grpc, google.protobuf as p; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "grpcio", grpc.__version__, "protobuf", p.__version__)' 2>&1 | tail -1)"
export PYTHONPATH=$site KVCD_BINARY=$root/.devbin/kvcd

# 1. tests
(cd client/python/tests &&
  step tests 200 "$py" -m pytest -p no:cacheprovider -q -rs test_vllm_gpu.py test_cuda_ipc.py)

# 2. bench: a CUDA daemon on a free loopback port, always stopped.
cfg=$out/bench-daemon.yaml
cat > "$cfg" <<YAML
listen: 127.0.0.1:0
metrics_listen: ""
backend: cuda
memory_budget: 24GiB
drain_timeout_ms: 300
YAML
.devbin/kvcd serve --config "$cfg" > "$out/bench-daemon.out" 2> "$out/bench-daemon.err" &
dpid=$!
trap 'kill "$dpid" 2>/dev/null; wait "$dpid" 2>/dev/null' EXIT
ready=$(timeout 60 tail -n +1 -f "$out/bench-daemon.out" | grep -m1 '^kvcd ready')
target=$(sed -n 's/.*grpc=\([^ ]*\).*/\1/p' <<< "$ready")
if [[ -z $target ]]; then
  summary "bench daemon not ready: $(tail -5 "$out/bench-daemon.err")"
else
  step bench 200 "$py" bench/vllm_gpu_transfer_bench.py --target "$target" --out "$final/bench.json"
  grep -E '^(device|\|)' "$out/bench.log" | tee -a "$final/summary.txt"
  tail -5 "$out/bench.log" | grep -E 'Error|assert' | tee -a "$final/summary.txt"
fi
kill "$dpid" 2>/dev/null; wait "$dpid" 2>/dev/null; trap - EXIT
pack

# 3. the daemon under memcheck for the IPC tests (a wrapper the tests start as the binary).
# The tests stop the daemon with SIGTERM: the wrapper hands it to the daemon, the sanitizer's
# child (a SIGTERM to compute-sanitizer itself ends it before it writes its summary, as the
# first run of this script saw on 2026-12-05).
wrap=$out/kvcd-memcheck.sh
{
  echo '#!/usr/bin/env bash'
  echo "compute-sanitizer --tool memcheck --error-exitcode 9 --log-file $out/memcheck-%p.log \\"
  echo "  $root/.devbin/kvcd \"\$@\" &"
  echo "log_dir=$out"
  cat <<'WRAP'
sp=$!
forwarded=0
forward() { forwarded=1; pkill -"$1" -P "$sp" || kill -"$1" "$sp"; }
trap 'forward TERM' TERM
trap 'forward INT' INT
while :; do
  wait "$sp"
  rc=$?
  kill -0 "$sp" 2>/dev/null && continue
  # After a forwarded signal compute-sanitizer may not learn the daemon's exit status (it
  # printed "couldn't find exit code" and exited 1 on 2026-12-05): then its log decides, 0
  # when it summarised 0 errors, 9 (errors) when it summarised any, its own status otherwise.
  if [[ $forwarded == 1 && $rc != 0 && $rc != 9 ]]; then
    summary=$(grep -h 'ERROR SUMMARY' "$log_dir/memcheck-$sp.log" 2>/dev/null | tail -1)
    [[ $summary == *"ERROR SUMMARY: 0 errors"* ]] && exit 0
    [[ -n $summary ]] && exit 9
  fi
  exit "$rc"
done
WRAP
} > "$wrap"
chmod +x "$wrap"
(cd client/python/tests && KVCD_BINARY=$wrap step memcheck 120 "$py" -m pytest -p no:cacheprovider \
  -q -rs test_vllm_gpu.py -k "bf16_blocks or compressed or larger")
summary "memcheck: $(cat "$out"/memcheck-*.log 2>/dev/null | grep -E 'ERROR SUMMARY' | sort | uniq -c | tr '\n' ' ')"
pack
