#!/usr/bin/env bash
# kvcd-int2-study --code-bits: the key code of the variants and of the codec file it writes
# (version 3) takes that many code bits per row (default 144, INT2's budget less the gain
# at head_dim 64; 272 at head_dim 128, bench/make-qwen3-transform-codec.sh); a value that is
# not a multiple of 8 in 8..8 * head_dim is a one-line usage error (exit 2).
#   usage: int2_study_code_bits_test.sh KVCD_CALIBRATE KVCD_INT2_STUDY
set -uo pipefail
calibrate=$1 study=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# A head_dim-128 dump of one layer: 320 tokens, the fewest the study fits on.
"$calibrate" synth --out "$dir/dump.safetensors" --tokens 320 --layers 1 --q-heads 2 \
  --kv-heads 1 --head-dim 128 --seed 3 >/dev/null || fail "kvcd-calibrate synth failed"

# run_study WANT_KEY_BITS WANT_FILE_BITS_PER_ELEMENT [FLAGS...]: exit 0, layer 0's key
# allocation sums to WANT_KEY_BITS, the written file scores at WANT_FILE_BITS_PER_ELEMENT
# (the key row's (code bits + 16) / 128 and the value row's INT2 2.25, averaged).
run_study() {
  local want_bits=$1 want_el=$2 out rc sum el
  shift 2
  rm -f "$dir/codec.safetensors"
  out=$("$study" --calib "$dir/dump.safetensors" --heldout "$dir/dump.safetensors" \
    --variants best --positions 1 --recent 248 --out-codec "$dir/codec.safetensors" "$@" 2>&1)
  rc=$?
  [[ $rc == 0 ]] || { fail "study $* exited $rc: $out"; return; }
  sum=$(sed -n 's/^bits per direction, tc-whiten, layer 0 head 0 K://p' <<<"$out" |
    tr ' ' '\n' | awk '{ s += $1 } END { print s + 0 }')
  [[ $sum == "$want_bits" ]] || fail "study $*: key bits sum to $sum, expected $want_bits: $out"
  el=$(awk -v f="file:$dir/codec.safetensors" '$1 == f { print $5 }' <<<"$out")
  [[ $el == "$want_el" ]] || fail "study $*: the file scores at '$el' bits per element, expected $want_el: $out"
  [[ -s $dir/codec.safetensors ]] || fail "study $* wrote no codec file"
}
run_study 144 1.750
run_study 272 2.250 --code-bits 272
run_study 1024 5.188 --code-bits 1024

# bad_value VALUE: exit 2, one line naming --code-bits and the value.
bad_value() {
  local out rc
  out=$("$study" --calib "$dir/dump.safetensors" --heldout "$dir/dump.safetensors" \
    --code-bits "$1" 2>&1)
  rc=$?
  [[ $rc == 2 ]] || fail "--code-bits $1 exited $rc, expected 2: $out"
  [[ $(wc -l <<<"$out") == 1 ]] || fail "--code-bits $1 printed more than one line: $out"
  grep -qF -- "bad value for --code-bits: $1" <<<"$out" || fail "--code-bits $1 not named: $out"
}
bad_value 100
bad_value 0
bad_value 1032

((failures == 0)) && echo "int2_study_code_bits: all passed"
exit $((failures > 0))
