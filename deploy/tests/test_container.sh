#!/usr/bin/env bash
# Builds the kvcd image (deploy/container/build-image.sh), runs it with its ports published
# on 127.0.0.1 only, drives it with kvctl (health on the health port, stats, put, match),
# scrapes its /metrics through promtool, checks the HEALTHCHECK turns healthy and the daemon
# runs as a non-root user, then `docker stop` must drain it and exit 0.
#   deploy/tests/test_container.sh [IMAGE]   (an already built image skips the build)
set -euo pipefail
cd "$(dirname "$0")/../.."
kvctl=${KVCTL_BIN:-${KVCD_BUILD_DIR:-build}/client/kvctl}
fail() { echo "test_container: FAIL: $*" >&2; exit 1; }
image=${1:-}
if [[ -z $image ]]; then
  image=$(deploy/container/build-image.sh | tail -1)
fi
name=kvcd-test-$$
trap 'docker rm -f "$name" >/dev/null 2>&1 || true' EXIT
args=(serve --config /etc/kvcd/kvcd.yaml)
# Plaintext on 0.0.0.0 (inside the container) needs --insecure.
args+=(--insecure)
docker run -d --name "$name" -p 127.0.0.1::50051 -p 127.0.0.1::8081 -p 127.0.0.1::9464 \
  "$image" "${args[@]}" >/dev/null
port() { docker port "$name" "$1/tcp" | head -1; }
grpc=$(port 50051) health=$(port 8081) metrics=$(port 9464)
for p in "$grpc" "$health" "$metrics"; do
  [[ $p == 127.0.0.1:* ]] || fail "port published as '$p', not on 127.0.0.1 only"
done
[[ -z $(docker port "$name" | grep -v ' 127\.0\.0\.1:') ]] || fail "a port is published beyond loopback"

for _ in $(seq 120); do
  "$kvctl" --target "$health" --deadline-ms 1000 health >/dev/null 2>&1 && break
  [[ $(docker inspect -f '{{.State.Running}}' "$name") == true ]] || { docker logs "$name"; fail "container exited"; }
  sleep 0.5
done
[[ $("$kvctl" --target "$health" health) == SERVING ]] || fail "health port not SERVING"
[[ $(docker inspect -f '{{.Config.User}}' "$image") == 10001:10001 ]] || fail "image user is not 10001"
[[ $(docker exec "$name" id -u) == 10001 ]] || fail "daemon does not run as uid 10001"

"$kvctl" --target "$grpc" stats | grep -q 'backend cpu' || fail "stats"
"$kvctl" --target "$grpc" put --model qwen3-8b --synthetic 192 --seed 11 | grep -q '192 inserted' || fail "put"
"$kvctl" --target "$grpc" match --model qwen3-8b --synthetic 192 --seed 11 | grep -q '^192 tokens' || fail "match"
"$kvctl" --target "$grpc" stats | grep -q 'hit ratio' || fail "stats after put"

body=$(curl -sf "http://$metrics/metrics") || fail "metrics port"
grep -q 'kvcd_inserted_pages_total 3' <<<"$body" || fail "kvcd_inserted_pages_total is not 3"
promtool check metrics <<<"$body" || fail "promtool check metrics"

for _ in $(seq 60); do
  status=$(docker inspect -f '{{.State.Health.Status}}' "$name")
  [[ $status == healthy ]] && break
  sleep 1
done
[[ $status == healthy ]] || fail "HEALTHCHECK status '$status'"

start=$(date +%s)
docker stop -t 15 "$name" >/dev/null
code=$(docker inspect -f '{{.State.ExitCode}}' "$name")
docker logs "$name" 2>&1 | grep -q 'drained, exiting' || { docker logs "$name"; fail "no drain in the log"; }
[[ $code == 0 ]] || { docker logs "$name"; fail "exit code $code after docker stop"; }
echo "test_container: PASS ($image: health, stats, put, match, metrics, HEALTHCHECK healthy," \
  "uid 10001, docker stop drained and exited 0 in $(($(date +%s) - start)) s)"
