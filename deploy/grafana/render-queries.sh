#!/usr/bin/env bash
# Renders the dashboard's key queries as a PNG without Grafana (not installable here): runs
# the live metrics test (a real kvcd scraped by a real Prometheus under a kvctl workload)
# and, while its Prometheus still runs, screenshots Prometheus's own graph page with
# headless Chromium (Debian's chromium-headless-shell).
#   deploy/grafana/render-queries.sh [OUT.png]   (default deploy/grafana/kvcd-queries.png)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-deploy/grafana/kvcd-queries.png}
command -v chromium-headless-shell >/dev/null ||
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium-headless-shell >/dev/null
# The deployment checks' venv (scripts/test-deploy.sh --prepare makes it).
venv=$(scripts/test-deploy.sh --venv-path)
[[ -x $venv/bin/python ]] || { echo "render-queries: no deploy venv; run scripts/test-deploy.sh --prepare" >&2; exit 1; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
KVCD_SCREENSHOT_DIR=$dir "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  deploy/tests/test_live_metrics.py -k key_queries &
test_pid=$!
for _ in $(seq 600); do
  [[ -s $dir/url ]] && break
  kill -0 "$test_pid" 2>/dev/null || break
  sleep 0.5
done
[[ -s $dir/url ]] || { wait "$test_pid"; echo "render-queries: the test gave no URL" >&2; exit 1; }
sleep 3  # let the page's own range (1 minute) fill with the scrapes after the workload
chromium-headless-shell --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,4700 \
  --virtual-time-budget=15000 --screenshot="$PWD/$out" "$(cat "$dir/url")" 2>"$dir/chromium.log" ||
  { cat "$dir/chromium.log" >&2; exit 1; }
touch "$dir/done"
wait "$test_pid"
echo "wrote $out"
