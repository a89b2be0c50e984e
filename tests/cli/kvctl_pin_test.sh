#!/usr/bin/env bash
# kvctl pin / unpin / stats against the real daemon (loopback, cpu backend): a cached prompt
# is pinned (the pin id, tokens, pages and expiry are printed), stats lists the pin with its
# tenant, model and end, unpin removes it; bad input (no ttl, a ttl above max_pin_ttl_ms,
# nothing cached, an unknown pin id, no pin id) fails with a message naming what was wrong.
#   usage: kvctl_pin_test.sh KVCD_BINARY KVCTL_BINARY
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
max_pin_ttl_ms: 600000
quotas:
  tenants:
    - {tenant: team, max_pinned_prefix_pages: 8}
models:
  - builtin: tiny
    memory: 1MiB
YAML
start_kvcd "$kvcd" "$dir/kvcd.yaml" || exit 1
ctl() { "$kvctl" --target "$KVCD_GRPC" "$@"; }

expect 0 "cached" -- ctl put --model tiny --salt team --synthetic 18 --seed 3
out=$(ctl pin --model tiny --salt team --synthetic 18 --seed 3 --ttl-ms 600000 2>&1) ||
  fail "pin failed: $out"
grep -q "16 tokens (4 pages) pinned until 20[0-9-]* [0-9:]* UTC (in [0-9]* s)" <<<"$out" ||
  fail "pin printed: $out"
pin=$(sed -n 's/^pin \([0-9]*\):.*/\1/p' <<<"$out")
[[ -n $pin ]] || fail "no pin id in: $out"
expect 0 "pin $pin: tenant 'team', model tiny, 16 tokens (4 pages) until" -- ctl stats
expect 0 "tenant 'team': 4 pages pinned by prefix pins (quota 8)" -- ctl stats
expect 0 "prefix pins: 1" -- ctl stats

expect 2 "pin needs --ttl-ms N" -- ctl pin --model tiny --salt team --synthetic 18 --seed 3
expect 1 "ttl_ms is 600001, expected 1..600000" -- \
  ctl pin --model tiny --salt team --synthetic 18 --seed 3 --ttl-ms 600001
expect 1 "nothing to pin" -- ctl pin --model tiny --salt team --tokens 1,2,3,4,5 --ttl-ms 1000
# Pages count per pin: a second pin of the same prefix fills the quota of 8, a third is refused.
second=$(ctl pin --model tiny --salt team --synthetic 18 --seed 3 --ttl-ms 1000 2>&1) ||
  fail "second pin failed: $second"
expect 1 "max_pinned_prefix_pages is 8" -- \
  ctl pin --model tiny --salt team --synthetic 18 --seed 3 --ttl-ms 1000
expect 0 "pin" -- ctl unpin "$(sed -n 's/^pin \([0-9]*\):.*/\1/p' <<<"$second")"
expect 2 "unpin needs one PIN_ID" -- ctl unpin
expect 1 "NOT_FOUND" -- ctl unpin 12345
expect 0 "prefix pins: 1" -- ctl stats

expect 0 "pin $pin removed: 4 pages" -- ctl unpin "$pin"
expect 0 "prefix pins: 0" -- ctl stats
expect 1 "is not live" -- ctl unpin "$pin"

if ((failures > 0)); then echo "$failures check(s) failed"; exit 1; fi
echo "kvctl pin: all checks passed"
