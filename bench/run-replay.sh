#!/usr/bin/env bash
# Trace replay (docs/performance.md "Replaying a trace"): for each capacity, a fresh daemon on
# the CPU backend configured to evict only what a call needs (high_watermark 1: pure LRU at
# capacity), then kvcd-replay over the public Mooncake trace; writes a Markdown table of the
# hit rate beside the LRU simulation and the infinite-cache bound, committed reuse,
# throughput, the daemon's CPU share and RPC latency.
#   bench/run-replay.sh [--out FILE.md] [--requests N] [CAPACITY_PAGES...]
# Defaults: all requests; capacities 1953 5859 19531 pages (one page = one 512-token block:
# 1M, 3M and 10M trace tokens, the capacities of the trace's README). The trace is read from
# ../shared/data/traces/ (or KVCD_TRACE).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
source scripts/daemon-lib.sh
out=/dev/stdout requests=0 capacities=()
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    *) capacities+=("$1"); shift ;;
  esac
done
((${#capacities[@]})) || capacities=(1953 5859 19531)
trace=${KVCD_TRACE:-}
for t in ../shared/data/traces/mooncake_synthetic_trace.jsonl \
  ../../shared/data/traces/mooncake_synthetic_trace.jsonl; do
  [[ -n $trace ]] || { [[ -r $t ]] && trace=$t; }
done
[[ -r $trace ]] || { echo "run-replay.sh: no trace (set KVCD_TRACE)" >&2; exit 1; }
for b in "$build/server/kvcd" "$build/bench/kvcd-replay"; do
  [[ -x $b ]] || { echo "run-replay.sh: $b is not built (scripts/build.sh kvcd kvcd-replay)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'kill "${KVCD_PID:-}" 2>/dev/null || true; rm -rf "$work"' EXIT
page_bytes=8192  # page 16 tokens x 2 layers x 2 kv heads x head_dim 32, K and V, BF16
for cap in "${capacities[@]}"; do
  cat >"$work/kvcd.yaml" <<YAML
listen: 127.0.0.1:0
metrics_listen: ""
backend: cpu
memory_budget: $((cap * page_bytes + (16 << 20)))
high_watermark: 1.0
low_watermark: 0.99
worker_threads: 2
compute_threads: 1
YAML
  start_kvcd "$build/server/kvcd" "$work/kvcd.yaml"
  "$build/bench/kvcd-replay" --trace "$trace" --requests "$requests" --target "$KVCD_GRPC" \
    --capacity-pages "$cap" --high-watermark 1 --low-watermark 0.99 --daemon-pid "$KVCD_PID" \
    --json >"$work/$cap.json"
  stop_kvcd
done
python3 - "$work" "$trace" "$requests" "${capacities[@]}" >"$out" <<'PY'
import json, sys, os, platform, subprocess
work, trace, requests, caps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
runs = [json.load(open(os.path.join(work, c + ".json"))) for c in caps]
pct = lambda x: f"{100 * x:.2f}%"
w = runs[0]["workload"]
print(f"Trace: `{os.path.basename(trace)}`, {runs[0]['requests']} requests, "
      f"{w['prompt_tokens']:,} prompt tokens, {w['full_blocks']:,} full blocks "
      f"({w['distinct_blocks']:,} distinct); {w['continued_requests']} requests continued by a "
      f"later one, {w['commit_pages']} full output pages of which {w['commit_pages_continued']} "
      f"are a later prompt's blocks.\n")
print("| capacity (pages = trace tokens) | daemon hit rate | LRU simulation | daemon - LRU "
      "| requests matched differently | infinite cache | committed reuse (daemon / LRU sim / "
      "infinite) | commits | evicted pages (daemon / sim) | requests/s | daemon cores busy |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for r in runs:
    d, l, i, ic = r["daemon"], r["lru_simulation"], r["infinite"], r["infinite_with_commits"]
    print(f"| {r['capacity_pages']:,} = {r['capacity_trace_tokens'] / 1e6:.2f}M "
          f"| {pct(d['hit_rate'])} | {pct(l['hit_rate'])} "
          f"| {100 * (d['hit_rate'] - l['hit_rate']):+.3f} pt | {r['lru_mismatched_requests']} "
          f"| {pct(i['hit_rate'])} "
          f"| {pct(d['committed_hit_rate'])} / {pct(l['committed_hit_rate'])} / "
          f"{pct(ic['committed_hit_rate'])} | {r['commits_served']} "
          f"| {r['evicted_pages']:,} / {r['lru_evicted_pages']:,} "
          f"| {r['requests_per_second']:.1f} | {r.get('daemon_cores_busy', float('nan')):.2f} |")
print("\nRPC latency (ms, p50 / p90 / p99), every call succeeded "
      f"({', '.join(str(r['rpcs']) for r in runs)} RPCs):\n")
calls = ["Match", "Put", "OpenSequence", "Append", "CloseSequence"]
print("| capacity | " + " | ".join(calls) + " |")
print("|---|" + "---|" * len(calls))
for r in runs:
    cells = [f"{r['latency'][c]['p50_ms']:.2f} / {r['latency'][c]['p90_ms']:.2f} / "
             f"{r['latency'][c]['p99_ms']:.2f}" for c in calls]
    print(f"| {r['capacity_pages']:,} | " + " | ".join(cells) + " |")
PY
