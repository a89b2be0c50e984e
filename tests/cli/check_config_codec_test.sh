#!/usr/bin/env bash
# kvcd check-config opens and checks each model's codec_file as kvcd serve does (the format
# factories): a missing, malformed or mismatched codec file fails with exit status 2 and a
# message naming the model and the codec_file; a config without one passes.
#   usage: check_config_codec_test.sh KVCD_BINARY
set -uo pipefail
kvcd=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
# expect STATUS NEEDLE CONFIG_BODY: check-config's exit status and a line containing NEEDLE
expect() {
  local want=$1 needle=$2 body=$3 out rc
  printf 'listen: 127.0.0.1:0\nbackend: cpu\nmemory_budget: 64MiB\nmodels:\n%s\n' "$body" \
    >"$dir/kvcd.yaml"
  out=$("$kvcd" check-config --config "$dir/kvcd.yaml" 2>&1); rc=$?
  [[ $rc == "$want" ]] || fail "check-config exited $rc, expected $want: $out"
  grep -qF -- "$needle" <<<"$out" || fail "check-config printed no '$needle': $out"
}

printf 'not a safetensors file' >"$dir/garbage.safetensors"
model='  - builtin: tiny
    name: m
    memory: 1MiB'
expect 0 "config OK" "$model"
expect 0 "config OK" "$model
    history_format: int2-oscar
    codec: hadamard"
expect 2 "model 'm': codec_file '$dir/missing.safetensors'" "$model
    history_format: int2-oscar
    codec_file: $dir/missing.safetensors"
expect 2 "model 'm': codec_file '$dir/garbage.safetensors'" "$model
    history_format: int2-oscar
    codec_file: $dir/garbage.safetensors"
expect 2 "model 'm': codec_file '$dir/garbage.safetensors'" "$model
    history_format: fsq
    fsq_residual_width: 64
    fsq_latent_width: 21
    codec_file: $dir/garbage.safetensors"

((failures == 0)) && echo "check_config_codec: OK"
exit $((failures > 0))
