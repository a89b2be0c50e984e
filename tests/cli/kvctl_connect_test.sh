#!/usr/bin/env bash
# kvctl when it cannot reach the daemon (loopback, cpu backend, a TLS API port and a
# plaintext health port): each failure exits 1 within --deadline-ms (plus the one probe of
# the port, at most 2 s) and says why and what to do — a plaintext client on the TLS port
# hears that the server may require TLS, a TLS client on the plaintext port that the port
# does not speak TLS, and a closed port that nothing accepts connections. With the CA the
# same TLS port answers.
#   usage: kvctl_connect_test.sh KVCD_BINARY KVCTL_BINARY
set -uo pipefail
kvcd=$1 kvctl=$2
source "$(dirname "$0")/../../scripts/daemon-lib.sh"
dir=$(mktemp -d)
trap 'stop_kvcd >/dev/null 2>&1; rm -rf "$dir" "${KVCD_LOG_DIR:-}"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
# expect STATUS MAX_MS NEEDLE -- command...: exit status, a line containing NEEDLE, and done
# within MAX_MS milliseconds.
expect() {
  local want=$1 max_ms=$2 needle=$3; shift 4
  local out rc start elapsed
  start=$(date +%s%N)
  out=$("$@" 2>&1); rc=$?
  elapsed=$((($(date +%s%N) - start) / 1000000))
  [[ $rc == "$want" ]] || fail "$* exited $rc, expected $want: $out"
  grep -qF -- "$needle" <<<"$out" || fail "$* printed no '$needle': $out"
  ((elapsed <= max_ms)) || fail "$* took $elapsed ms, more than $max_ms: $out"
}

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -keyout "$dir/key.pem" -out "$dir/cert.pem" -subj /CN=localhost \
  -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" 2>/dev/null || { echo "openssl failed"; exit 1; }
cat >"$dir/kvcd.yaml" <<YAML
listen: 127.0.0.1:0
health_listen: 127.0.0.1:0
metrics_listen: ""
backend: cpu
memory_budget: 16MiB
tls:
  cert_file: $dir/cert.pem
  key_file: $dir/key.pem
models:
  - builtin: tiny
    memory: 1MiB
YAML
start_kvcd "$kvcd" "$dir/kvcd.yaml" || exit 1
health=$(sed -n 's/.*health=\([^ ]*\).*/\1/p' "$KVCD_LOG_DIR/out")

# A plaintext client on the TLS port: --deadline-ms bounds the wait, and the message says TLS.
expect 1 4000 "the server may require TLS" -- "$kvctl" --target "$KVCD_GRPC" --deadline-ms 1500 stats
expect 1 4000 "within 1500 ms" -- "$kvctl" --target "$KVCD_GRPC" --deadline-ms 1500 stats
expect 1 4000 "--tls-ca FILE" -- "$kvctl" --target "$KVCD_GRPC" --deadline-ms 1500 health
# With the CA the same port answers.
expect 0 10000 "backend cpu" -- "$kvctl" --target "$KVCD_GRPC" --tls-ca "$dir/cert.pem" stats
# A TLS client on the plaintext health port.
expect 1 4000 "the port answers but not with TLS" -- \
  "$kvctl" --target "$health" --tls-ca "$dir/cert.pem" --deadline-ms 1500 health
expect 0 10000 "SERVING" -- "$kvctl" --target "$health" health
# Nothing listening (the daemon's port once it has stopped).
stop_kvcd >/dev/null 2>&1
expect 1 4000 "nothing accepts connections on 127.0.0.1:" -- \
  "$kvctl" --target "$KVCD_GRPC" --deadline-ms 1000 health

if ((failures > 0)); then echo "$failures check(s) failed"; exit 1; fi
echo "kvctl connect: all checks passed"
