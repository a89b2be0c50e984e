# Sourced by the bench/run-h200-*.sh device scripts: the steps' logs, the summary and the
# packed logs they return. `device_steps NAME` sets
#   final  where the results go: $OUT on the device tool, else /tmp/kvcd-h200-NAME
#   out    the steps' logs (/tmp/kvcd-h200-NAME-logs), packed into $final/logs.tgz
#   BIN    the carried binaries (.devbin, or $KVCD_DEVBIN), their libraries on LD_LIBRARY_PATH
# and starts $final/summary.txt with the card. Then:
#   summary TEXT...            a line of the summary (also printed)
#   step NAME LIMIT CMD...     runs CMD with a time limit, its output in $out/NAME.log; the
#                              summary gets its exit status, time and gtest totals, and the
#                              names of failed tests
#   daemon_config BUDGET       prints the head of a device daemon's YAML config (loopback
#                              ports, the CUDA backend on device 0, BUDGET of memory, leases
#                              of 60-600 s, a 2 s drain) down to "models:"; the script adds
#                              its models
# NCCL's NVLink multicast stays off (the device tool's machines do not offer it).
device_steps() {
  final=${OUT:-/tmp/kvcd-h200-$1}
  out=/tmp/kvcd-h200-$1-logs
  mkdir -p "$final" "$out"
  export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=$PWD/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  BIN=${KVCD_DEVBIN:-.devbin}
  : >"$final/summary.txt"
  summary "$(nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm \
    --format=csv,noheader 2>&1)"
}
summary() { echo "$*" | tee -a "$final/summary.txt"; }
daemon_config() {
  cat <<YAML
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
backend: cuda
cuda_device: 0
memory_budget: $1
lease: {default_ms: 60000, max_ms: 600000}
drain_timeout_ms: 2000
models:
YAML
}
pack() { tar -czf "$final/logs.tgz" -C "$out" . 2>/dev/null; }
step() {
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" stdbuf -oL "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary "$name rc $rc ($((SECONDS - t0)) s): $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?' "$out/$name.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Za-z]' "$out/$name.log" | head -20 | tee -a "$final/summary.txt"
  pack
}
# The decode-loop benches' daemon config (bench/run-decode-batch.sh): budget $1, an INT2
# model (18 GiB, 15% of it BF16 windows and sinks) and a BF16 one (12 GiB).
decode_loop_config() {
  daemon_config "$1"
  cat <<'YAML'
  - builtin: qwen3-8b
    name: qwen3-8b-int2
    history_format: int2-oscar
    memory: 18GiB
    bf16_fraction: 0.15
  - builtin: qwen3-8b
    memory: 12GiB
YAML
}
# The decode-loop benches' int2-transform model (qwen3-8b-xform; its codec SYNTHETIC: timing
# only). xform_codec_start PATH makes the codec file in the background with the carried
# tools (bench/make-qwen3-transform-codec.sh, ~40-95 s of one core) unless it exists, setting
# xform_codec and xform_job; xform_codec_wait then sets xform=1 once the file is there;
# xform_model_config prints the model's entry for decode_loop_config's YAML;
# xform_loop_setup BUDGET waits for the codec, writes $out/kvcd-int2.yaml (decode_loop_config
# BUDGET, plus the int2-transform model where its codec is there) and sets runs (INT2 32k and
# 100k, BF16 32k, plus int2-transform 32k and 100k).
xform_codec_start() {
  xform_codec=$1
  xform_job=
  if [[ ! -f $xform_codec && -x $BIN/kvcd-calibrate && -x $BIN/kvcd-int2-study ]]; then
    KVCD_TOOLS=$BIN bench/make-qwen3-transform-codec.sh "$xform_codec" >"$out/xform-codec.log" 2>&1 &
    xform_job=$!
  fi
}
xform_codec_wait() {
  xform=0
  if [[ -n ${xform_job:-} ]]; then
    wait "$xform_job"
    local rc=$?
    summary "xform codec (synthetic, bench/make-qwen3-transform-codec.sh) rc $rc after $SECONDS s"
    [[ $rc == 0 ]] && xform=1
  elif [[ -f ${xform_codec:-} ]]; then
    xform=1
  fi
}
xform_model_config() {
  cat <<YAML
  - builtin: qwen3-8b
    name: qwen3-8b-xform
    history_format: int2-oscar
    codec_file: $(realpath "$xform_codec")
    memory: 18GiB
    bf16_fraction: 0.15
YAML
}
xform_loop_setup() {
  xform_codec_wait
  decode_loop_config "$1" > "$out/kvcd-int2.yaml"
  runs="qwen3-8b-int2:32768 qwen3-8b-int2:99968 qwen3-8b:32768"
  if [[ $xform == 1 ]]; then
    xform_model_config >> "$out/kvcd-int2.yaml"
    runs+=" qwen3-8b-xform:32768 qwen3-8b-xform:99968"
  fi
}
