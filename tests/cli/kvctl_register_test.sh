#!/usr/bin/env bash
# kvctl register against the real daemon (loopback, cpu backend): a ModelProfile in protobuf
# text format registers a model that put and match then use; a name registered twice, a
# malformed or missing profile file, a profile the daemon refuses and an unreadable codec
# each fail with exit status 1 and a message naming what was wrong, registering nothing.
# Also the session commands' refusals (commit, fork, close).
#   usage: kvctl_register_test.sh KVCD_BINARY KVCTL_BINARY
set -uo pipefail
kvcd=$1 kvctl=$2
source "$(dirname "$0")/../../scripts/daemon-lib.sh"
dir=$(mktemp -d)
trap 'stop_kvcd >/dev/null 2>&1; rm -rf "$dir" "${KVCD_LOG_DIR:-}"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
# expect STATUS NEEDLE -- command...: exit status and a line of its output containing NEEDLE
expect() {
  local want=$1 needle=$2; shift 3
  local out rc
  out=$("$@" 2>&1); rc=$?
  [[ $rc == "$want" ]] || fail "$* exited $rc, expected $want: $out"
  grep -qF -- "$needle" <<<"$out" || fail "$* printed no '$needle': $out"
}

cat > "$dir/kvcd.yaml" <<'YAML'
listen: 127.0.0.1:0
metrics_listen: 127.0.0.1:0
backend: cpu
memory_budget: 64MiB
models:
  - builtin: tiny
    memory: 1MiB
YAML
start_kvcd "$kvcd" "$dir/kvcd.yaml" || exit 1
ctl() { "$kvctl" --target "$KVCD_GRPC" "$@"; }

cat > "$dir/small-int2.textproto" <<'TXT'
# a small INT2 model (no codec: Hadamard rotation)
name: "small-int2"
num_layers: 2 num_q_heads: 4 num_kv_heads: 2 head_dim: 16
page_size: 4 sink_tokens: 4 recent_tokens: 8
history_format: HISTORY_FORMAT_INT2_OSCAR
memory_bytes: 1048576 bf16_fraction: 0.5
TXT
expect 0 "registered small-int2: 2 layers, 4 q / 2 kv heads, head_dim 16" -- \
  ctl register --profile "$dir/small-int2.textproto"
expect 0 "pool int2-oscar" -- ctl models
expect 0 "cached" -- ctl put --model small-int2 --synthetic 40 --seed 3
expect 0 "40 tokens (10 pages) cached" -- ctl match --model small-int2 --synthetic 40 --seed 3

# The same profile again is idempotent: the model and its cached pages stay.
expect 0 "cached tokens 40" -- ctl register --profile "$dir/small-int2.textproto"
# Refusals: each names its cause; none registers or changes anything.
sed 's/num_layers: 2/num_layers: 3/' "$dir/small-int2.textproto" > "$dir/other-layers.textproto"
expect 1 "ALREADY_EXISTS" -- ctl register --profile "$dir/other-layers.textproto"
printf 'name: "broken"\nnum_layers: two\n' > "$dir/broken.textproto"
expect 1 "line 2 column 13" -- ctl register --profile "$dir/broken.textproto"
expect 1 "kvctl register: cannot open profile file '$dir/absent.textproto': No such file" -- \
  ctl register --profile "$dir/absent.textproto"
# A local file's error is not a gRPC code, and comes before (and without) any daemon.
out=$("$kvctl" --target 127.0.0.1:1 register --profile "$dir/absent.textproto" 2>&1)
[[ $? == 1 ]] || fail "register with an absent profile and no daemon did not exit 1: $out"
grep -q "NOT_FOUND\|UNAVAILABLE" <<<"$out" && fail "a local file error named a gRPC code: $out"
grep -qF "cannot open profile file" <<<"$out" || fail "no local file error without a daemon: $out"
sed -e 's/small-int2/bad-dim/' -e 's/head_dim: 16/head_dim: 12/' "$dir/small-int2.textproto" \
  > "$dir/bad-dim.textproto"
expect 1 "INVALID_ARGUMENT" -- ctl register --profile "$dir/bad-dim.textproto"
expect 1 "head_dim" -- ctl register --profile "$dir/bad-dim.textproto"
sed 's/small-int2/bad-codec/' "$dir/small-int2.textproto" > "$dir/bad-codec.textproto"
head -c 100 /dev/urandom > "$dir/garbage.safetensors"
expect 1 "INVALID_ARGUMENT" -- ctl register --profile "$dir/bad-codec.textproto" \
  --codec "$dir/garbage.safetensors"
expect 1 "kvctl register: cannot open codec file" -- ctl register --profile "$dir/bad-codec.textproto" \
  --codec "$dir/absent.safetensors"
expect 2 "register needs --profile FILE" -- ctl register
models=$(ctl models)
for m in broken bad-dim bad-codec; do
  grep -q "^$m:" <<<"$models" && fail "model $m was registered by a refused call"
done
[[ $(grep -c '^[a-z0-9-]*:' <<<"$models") == 2 ]] || fail "expected tiny and small-int2: $models"
grep -q "^small-int2: 2 layers" <<<"$models" || fail "small-int2 changed: $models"

# The session commands (docs/sessions.md) name the sequence as their one argument: an id
# that is not open is NOT_FOUND (exit 1); a missing or malformed one a usage error (exit 2).
expect 1 "NOT_FOUND" -- ctl commit 12345
expect 1 "NOT_FOUND" -- ctl fork 12345 --lease-ms 1000
expect 1 "NOT_FOUND" -- ctl close 12345 --commit
expect 2 "expected one SEQUENCE_ID" -- ctl commit
expect 2 "SEQUENCE_ID must be an unsigned 64-bit integer" -- ctl fork abc
expect 0 "sessions: 0 committed pages cached, 0 forks" -- ctl stats

if ((failures > 0)); then echo "$failures check(s) failed"; exit 1; fi
echo "kvctl register: all checks passed"
